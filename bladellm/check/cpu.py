"""The CPU: instruction sets and what they mean for ``--dtype auto``, cores and threads, and
``/dev/shm``."""

from __future__ import annotations

import os

from bladellm import envs
from bladellm.check.result import FAILED, PASS, WARNING, CheckResult
from bladellm.platforms.cpu import CpuInfo, cgroup_cpu_limit
from bladellm.platforms.cpu_defaults import GiB, choose_cpu_dtype
from bladellm.platforms.threads import engine_threads

SHM_PATH = "/dev/shm"
SHM_RECOMMENDED = 1 * GiB


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def check_cpu_isa(cpu: CpuInfo) -> CheckResult:
    dtype = choose_cpu_dtype("auto", "bfloat16", cpu)
    detail = (f"{cpu.model_name}: AVX2 {_yes(cpu.has_avx2)}, AVX-512 {_yes(cpu.has_avx512)}, "
              f"AVX-512-BF16 {_yes(cpu.has_avx512_bf16)}, AMX {_yes(cpu.has_amx)}; kernels "
              f"target {cpu.isa}; --dtype auto loads a bf16/fp16 checkpoint as {dtype.dtype}")
    if not cpu.has_avx2:
        return CheckResult("cpu_isa", WARNING, detail + " (no AVX2: the compiled kernels fall "
                                                        "back to generic code and run slowly)")
    return CheckResult("cpu_isa", PASS, detail)


def check_threads(cpu: CpuInfo, num_threads: int | None) -> CheckResult:
    """Usable CPUs (affinity, cgroup quota) and the engine's thread count at these flags."""
    total = os.cpu_count() or cpu.num_cpus
    quota = cgroup_cpu_limit()
    threads = engine_threads(num_threads, cpu.num_cpus)
    where = f"--num_threads {num_threads}" if num_threads else (
        "OMP_NUM_THREADS" if envs.omp_num_threads() else "one per usable CPU")
    detail = (f"{cpu.num_cpus} usable CPUs of {total}"
              + (f" (cgroup quota {quota:g} CPUs)" if quota is not None else "")
              + f"; engine threads {threads} ({where})")
    if threads > cpu.num_cpus:
        return CheckResult("cpu_threads", WARNING, detail + ": more threads than usable CPUs "
                                                            "oversubscribe and slow every step")
    if cpu.num_cpus < 2:
        return CheckResult("cpu_threads", WARNING, detail + ": the HTTP server and the engine "
                                                            "share one CPU")
    return CheckResult("cpu_threads", PASS, detail)


def check_shm(path: str = SHM_PATH) -> CheckResult:
    """Shared memory backs torch's multiprocessing tensors and gloo between ranks; containers
    often default to a 64 MB /dev/shm."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return CheckResult("shm", FAILED, f"{path} is not available ({exc})")
    size, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    detail = f"{path}: {size / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
    if not os.access(path, os.W_OK):
        return CheckResult("shm", FAILED, detail + ", not writable")
    if free < SHM_RECOMMENDED:
        return CheckResult("shm", WARNING, detail + f" (< {SHM_RECOMMENDED // GiB} GiB free: "
                                                    "multi-process ranks may fail; e.g. docker "
                                                    "run --shm-size 8g)")
    return CheckResult("shm", PASS, detail)
