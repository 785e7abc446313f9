"""CPU features: read once from ``/proc/cpuinfo`` and kept in one small dataclass.

Kernel selection, ``--dtype auto`` and thread defaults all decide from a ``CpuInfo``; tests build
one with a faked flag set instead of patching the machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    num_cpus: int  # CPUs this process may use (affinity, cut by a cgroup quota), not the total

    @property
    def has_avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def has_avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl"} <= self.flags

    @property
    def has_avx512_bf16(self) -> bool:
        return self.has_avx512 and "avx512_bf16" in self.flags

    @property
    def has_amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def has_native_bf16(self) -> bool:
        """bf16 GEMMs run at or above fp32 speed (AVX-512-BF16 or AMX); without it bf16 is
        emulated (oneDNN's GEMMs several times slower than fp32)."""
        return self.has_avx512_bf16 or self.has_amx

    @property
    def isa(self) -> str:
        """The best ISA level kernels may target: amx > avx512_bf16 > avx512 > avx2 > generic."""
        for name, ok in (("amx", self.has_amx), ("avx512_bf16", self.has_avx512_bf16),
                         ("avx512", self.has_avx512), ("avx2", self.has_avx2)):
            if ok:
                return name
        return "generic"

    def describe(self) -> str:
        interesting = sorted(f for f in self.flags
                             if f.startswith(("avx", "amx", "fma")) or f in ("f16c",))
        return f"{self.model_name}, {self.num_cpus} CPUs, ISA {self.isa} ({' '.join(interesting)})"


def _affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_dirs(controller: str, root: str = CGROUP_ROOT,
                self_cgroup: str | None = None) -> list[str]:
    """This process's cgroup directories for ``controller``, its own first, then its ancestors.

    ``self_cgroup`` is the text of ``/proc/self/cgroup``. A v2 line (``0::/path``) maps to
    ``root/path``, a v1 line (``4:memory:/path``) to ``root/memory/path``. Every ancestor's limit
    applies too, so callers take the smallest value found; directories that do not exist (a
    container that sees its own cgroup as the mount root) are skipped."""
    if self_cgroup is None:
        self_cgroup = read_text("/proc/self/cgroup") or ""
    dirs: list[str] = []
    for line in self_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            base = root
        elif controller in controllers.split(","):
            base = os.path.join(root, controller)
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def cgroup_cpu_limit(root: str = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time the cgroup quota allows (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None when there is no quota."""
    limits = []
    for d in cgroup_dirs("cpu", root, self_cgroup):
        quota, _, period = (read_text(os.path.join(d, "cpu.max")) or "max").partition(" ")
        if quota != "max" and quota.isdigit() and period.strip().isdigit():
            limits.append(int(quota) / int(period))
        quota = read_text(os.path.join(d, "cpu.cfs_quota_us")) or "-1"
        period = read_text(os.path.join(d, "cpu.cfs_period_us")) or "0"
        if quota.isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def usable_cpus(affinity_cpus: int, cpu_limit: float | None) -> int:
    """CPUs worth giving threads: the affinity set, cut to a cgroup quota rounded down (a thread
    past the quota only gets the whole process throttled at every period), at least 1."""
    if cpu_limit is not None:
        affinity_cpus = min(affinity_cpus, int(cpu_limit))
    return max(1, affinity_cpus)


def parse_cpuinfo(text: str, num_cpus: int) -> CpuInfo:
    """``CpuInfo`` from the text of ``/proc/cpuinfo`` (the first processor's entry)."""
    model, flags = platform.processor() or "unknown CPU", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model in ("", "unknown CPU", platform.processor()):
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return CpuInfo(model_name=model or "unknown CPU", flags=frozenset(flags.split()),
                   num_cpus=num_cpus)


@functools.lru_cache(maxsize=1)
def detect_cpu() -> CpuInfo:
    """This machine's CPU (cached: the hardware does not change while we run)."""
    text = read_text("/proc/cpuinfo") or ""
    return parse_cpuinfo(text, usable_cpus(_affinity_cpus(), cgroup_cpu_limit()))
