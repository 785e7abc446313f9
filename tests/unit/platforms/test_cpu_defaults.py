"""CPU defaults decided from a faked machine: dtype, threads, OpenMP env, KV-cache size."""

import importlib
import logging
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

from bladellm.model.loader import resolve_dtype
from bladellm.platforms.cpu import CpuInfo, cgroup_cpu_limit, parse_cpuinfo, usable_cpus
from bladellm.platforms.cpu_defaults import (GiB, auto_kv_cache_bytes, cgroup_memory_limit,
                                             choose_cpu_dtype, model_weight_bytes,
                                             physical_memory_bytes, total_memory_bytes)
from bladellm.platforms.threads import (default_engine_threads, engine_process_env,
                                        engine_threads, process_env)

AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma avx f16c avx2 bmi2"
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512dq avx512_vnni"
EPYC_ROME = f"""processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: {AVX2} sha_ni clzero

processor\t: 1
model name\t: AMD EPYC 7B12 64-Core Processor
flags\t\t: {AVX2} sha_ni clzero
"""
SAPPHIRE_RAPIDS = f"""processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: {AVX512} avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def cpu(flags: str, num_cpus: int = 8) -> CpuInfo:
    return CpuInfo("test CPU", frozenset(flags.split()), num_cpus)


AVX2_ONLY = cpu(AVX2)
ZEN4 = cpu(AVX512 + " avx512_bf16")
AMX = cpu(AVX512 + " amx_bf16 amx_tile")  # AMX without AVX512_BF16 still counts as native


# ---- /proc/cpuinfo ---------------------------------------------------------------------------

def test_parse_cpuinfo_avx2_only_epyc():
    info = parse_cpuinfo(EPYC_ROME, num_cpus=2)
    assert info.model_name == "AMD EPYC 7B12 64-Core Processor" and info.num_cpus == 2
    assert info.has_avx2 and not info.has_avx512 and not info.has_native_bf16
    assert info.isa == "avx2"


def test_parse_cpuinfo_amx_xeon():
    info = parse_cpuinfo(SAPPHIRE_RAPIDS, num_cpus=56)
    assert info.has_amx and info.has_avx512_bf16 and info.has_native_bf16
    assert info.isa == "amx"


# ---- --dtype ---------------------------------------------------------------------------------

@pytest.mark.parametrize("machine, checkpoint, expected", [
    (AVX2_ONLY, "bfloat16", "float32"),  # emulated bf16 is ~5x slower than fp32 there
    (AVX2_ONLY, "float16", "float32"),
    (ZEN4, "bfloat16", "bfloat16"),
    (ZEN4, "float16", "bfloat16"),
    (AMX, "bfloat16", "bfloat16"),
    (AMX, "float32", "bfloat16"),  # native bf16: served in bf16, as vLLM's auto does
    (ZEN4, "float32", "bfloat16"),
    (ZEN4, None, "bfloat16"),  # config states no dtype
    (AVX2_ONLY, "float32", "float32"),
    (AVX2_ONLY, None, "float32"),
])
def test_dtype_auto(machine, checkpoint, expected):
    assert choose_cpu_dtype("auto", checkpoint, machine).dtype == expected


def test_dtype_auto_says_why():
    assert choose_cpu_dtype("auto", "bfloat16", ZEN4).reason == \
        "checkpoint bfloat16, CPU has avx512_bf16"
    assert "amx_bf16" in choose_cpu_dtype("auto", "bfloat16", AMX).reason
    assert "no native bf16" in choose_cpu_dtype("auto", "bfloat16", AVX2_ONLY).reason
    assert "--dtype float32 keeps float32" in choose_cpu_dtype("auto", "float32", ZEN4).reason


@pytest.mark.parametrize("machine", [AVX2_ONLY, ZEN4, AMX])
@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_always_wins(machine, requested):
    assert choose_cpu_dtype(requested, "bfloat16", machine).dtype == requested
    assert choose_cpu_dtype(requested, "float32", machine).dtype == requested


def test_explicit_bfloat16_without_native_bf16_warns():
    assert "slower" in choose_cpu_dtype("bfloat16", "bfloat16", AVX2_ONLY).warning
    assert choose_cpu_dtype("bfloat16", "bfloat16", ZEN4).warning is None
    assert choose_cpu_dtype("float32", "bfloat16", AVX2_ONLY).warning is None


def test_resolve_dtype_logs_the_choice(caplog):
    bf16_config = SimpleNamespace(dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="bladellm.model.loader"):
        assert resolve_dtype(bf16_config, "auto", cpu=AVX2_ONLY) == torch.float32
        assert resolve_dtype(bf16_config, "auto", cpu=AMX) == torch.bfloat16
        assert resolve_dtype(SimpleNamespace(torch_dtype="float32"), "auto",
                             cpu=AMX) == torch.bfloat16
        assert resolve_dtype(bf16_config, "bfloat16", cpu=AVX2_ONLY) == torch.bfloat16
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("dtype auto: float32 (checkpoint bfloat16, CPU has no native")
    assert messages[1] == "dtype auto: bfloat16 (checkpoint bfloat16, CPU has amx_bf16)"
    assert messages[2] == ("dtype auto: bfloat16 (checkpoint float32, CPU has amx_bf16; "
                           "--dtype float32 keeps float32)")
    assert caplog.records[3].levelno == logging.WARNING and "slower" in messages[3]


# ---- threads ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_cpus, expected", [(1, 1), (2, 2), (16, 16), (0, 1)])
def test_default_engine_threads_one_per_usable_cpu(num_cpus, expected):
    assert default_engine_threads(num_cpus) == expected
    assert engine_threads(None, num_cpus, environ={}) == expected


def test_num_threads_flag_then_omp_num_threads_then_default():
    assert engine_threads(3, 16, environ={"OMP_NUM_THREADS": "5"}) == 3
    assert engine_threads(None, 16, environ={"OMP_NUM_THREADS": "5"}) == 5
    assert engine_threads(None, 16, environ={"OMP_NUM_THREADS": "bogus"}) == 16


def _cgroup(tmp_path, files: dict[str, str], self_cgroup: str) -> tuple[str, str]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(tmp_path), self_cgroup


def test_more_threads_than_usable_cpus_warns(monkeypatch, caplog):
    import bladellm.platforms.threads as threads

    monkeypatch.setattr(threads, "detect_cpu", lambda: CpuInfo("x", frozenset({"avx2"}), 2))
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="bladellm.platforms.threads"):
            assert threads.configure_engine_threads(2) == 2
            assert not caplog.records
            assert threads.configure_engine_threads(5) == 5
        assert "5 engine threads" in caplog.text and "2 usable CPUs" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_cpu_quota_cuts_usable_cpus(tmp_path):
    # cgroup v2: 1.5 CPUs of quota on a 16-CPU affinity set -> 1 thread
    root, me = _cgroup(tmp_path, {"job/cpu.max": "150000 100000"}, "0::/job")
    assert cgroup_cpu_limit(root, me) == 1.5
    assert usable_cpus(16, cgroup_cpu_limit(root, me)) == 1
    assert usable_cpus(2, 4.0) == 2 and usable_cpus(8, None) == 8


def test_cpu_quota_v1_and_unlimited(tmp_path):
    root, me = _cgroup(tmp_path, {"cpu/a/cpu.cfs_quota_us": "400000",
                                  "cpu/a/cpu.cfs_period_us": "100000",
                                  "cpu/cpu.cfs_quota_us": "-1"}, "3:cpu,cpuacct:/a")
    assert cgroup_cpu_limit(root, me) == 4.0
    root, me = _cgroup(tmp_path / "v2", {"cpu.max": "max 100000"}, "0::/")
    assert cgroup_cpu_limit(root, me) is None


def test_engine_process_env_sets_a_short_spin_unless_the_user_chose():
    assert engine_process_env({}) == {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
    assert engine_process_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert engine_process_env({"GOMP_SPINCOUNT": "10000"}) == {}
    assert engine_process_env({"KMP_BLOCKTIME": "5"}) == {}


def test_spawned_engine_process_starts_openmp_with_the_policy(capfd, monkeypatch):
    """The recipe for the engine-core process: its torch's OpenMP runtime really reads the
    policy, and the parent's environment is left as it was."""
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(var, raising=False)
    env = engine_process_env() | {"OMP_DISPLAY_ENV": "verbose"}  # libgomp prints its settings
    with process_env(env):
        proc = multiprocessing.get_context("spawn").Process(
            target=importlib.import_module, args=("torch",))
        proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert "GOMP_SPINCOUNT = '1000'" in capfd.readouterr().err
    assert "GOMP_SPINCOUNT" not in os.environ and "OMP_DISPLAY_ENV" not in os.environ


# ---- --kv_cache_memory auto --------------------------------------------------------------------

def test_auto_kv_cache_is_a_quarter_of_what_the_weights_leave_capped():
    assert auto_kv_cache_bytes(16 * GiB, 0) == 4 * GiB
    assert auto_kv_cache_bytes(24 * GiB, 8 * GiB) == 4 * GiB
    assert auto_kv_cache_bytes(256 * GiB, 14 * GiB) == 8 * GiB  # the cap
    assert auto_kv_cache_bytes(8 * GiB, 10 * GiB) == 0  # no room: the scheduler names the flag


def test_explicit_kv_cache_larger_than_the_machine_names_the_flag():
    """--num_kv_blocks / --kv_cache_memory past what the machine holds is a ValueError naming
    the flag, not torch's allocation failure (or a swapping machine) later."""
    from bladellm.platforms.cpu_defaults import KVCacheSizeError, kv_cache_num_blocks

    per_block, weights, total = 1 << 20, 2 * GiB, 8 * GiB
    args = dict(bytes_per_block=per_block, max_num_seqs=4, max_model_len=64, block_size=16,
                weight_bytes=weights, total_memory=total)
    assert kv_cache_num_blocks(1024, None, **args) == 1024
    assert kv_cache_num_blocks(None, 6 * GiB, **args) == 6 * 1024  # exactly fits
    with pytest.raises(KVCacheSizeError, match="--num_kv_blocks: 7000 KV blocks"):
        kv_cache_num_blocks(7000, None, **args)
    with pytest.raises(ValueError, match="--kv_cache_memory: .* exceeds this rank's 8.00 GiB"):
        kv_cache_num_blocks(None, 99999 * GiB, **args)


def test_total_memory_ignores_memory_in_use():
    """The old default took a share of *free* memory, so the pool changed from run to run."""
    before = total_memory_bytes()
    ballast = bytearray(b"x") * (256 << 20)  # touched, so it really is resident
    assert total_memory_bytes() == before <= physical_memory_bytes()
    del ballast


def test_cgroup_memory_limit_v2_lowest_ancestor_wins(tmp_path):
    root, me = _cgroup(tmp_path, {"memory.max": "max", "a/memory.max": str(2 * GiB),
                                  "a/b/memory.max": "max"}, "0::/a/b")
    assert cgroup_memory_limit(root, me) == 2 * GiB
    assert total_memory_bytes(root, me) == min(2 * GiB, physical_memory_bytes())


def test_cgroup_memory_limit_v1_unlimited_is_physical(tmp_path):
    root, me = _cgroup(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712"},
                       "4:memory:/")
    assert total_memory_bytes(root, me) == physical_memory_bytes()
    root, me = _cgroup(tmp_path / "none", {}, "0::/")
    assert cgroup_memory_limit(root, me) is None


def test_model_weight_bytes_counts_tied_weights_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))
    assert model_weight_bytes(model) == 10 * 4 * 4 + 3 * 2
