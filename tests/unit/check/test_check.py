"""``blade_llm_check``: the report format and exit code on this machine, forced failures, and
the individual checks on faked machines."""

from __future__ import annotations

import json
import re
import socket

import pytest

from bladellm.check.collective import check_all_reduce
from bladellm.check.cpu import check_cpu_isa, check_shm, check_threads
from bladellm.check.gpu import spread
from bladellm.check.memory import available_memory_bytes, check_memory
from bladellm.check.result import (FAILED, PASS, WARNING, CheckResult, exit_code, format_json,
                                   format_text)
from bladellm.config import EngineConfig
from bladellm.entrypoints.cli.check import main
from bladellm.platforms.cpu import CpuInfo

LINE = re.compile(r"^[a-z0-9_]+ (PASS|WARNING|FAILED) \S.*$")
SUMMARY = re.compile(r"^PASS (\d+), WARNING (\d+), FAILED (\d+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(out: str) -> tuple[list[str], tuple[int, int, int]]:
    lines = out.strip().splitlines()
    m = SUMMARY.match(lines[-1])
    assert m, lines[-1]
    return lines[:-1], tuple(int(x) for x in m.groups())


def test_this_machine_passes_for_a_tiny_model(tiny_llama, capsys):
    port = _free_port()
    rc = main(["--model", tiny_llama, "--host", "127.0.0.1", "--port", str(port),
               "--max_model_len", "256"])
    lines, (n_pass, n_warn, n_fail) = _report(capsys.readouterr().out)
    assert all(LINE.match(line) for line in lines), lines
    statuses = [line.split()[1] for line in lines]
    assert (statuses.count(PASS), statuses.count(WARNING), statuses.count(FAILED)) == (
        n_pass, n_warn, n_fail)
    names = {line.split()[0] for line in lines}
    assert {"python", "torch", "transformers", "cpu_isa", "cpu_threads", "shm", "memory", "gpu",
            f"port_{port}"} <= names
    assert n_fail == 0 and rc == 0


def test_too_little_memory_and_a_taken_port_fail_with_exit_1(tiny_llama, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["--model", tiny_llama, "--host", "127.0.0.1", "--port", str(port),
                   "--kv_cache_memory", "100000GiB", "--json"])
    report = json.loads(capsys.readouterr().out)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["memory"]["status"] == FAILED
    assert "--kv_cache_memory: " in by_name["memory"]["detail"]
    assert "take 100000.00 GiB" in by_name["memory"]["detail"]
    assert by_name[f"port_{port}"]["status"] == FAILED
    assert report["summary"][FAILED] == 2 and report["ok"] is False and rc == 1


def test_flags_the_engine_rejects_fail_but_the_rest_still_runs(tiny_llama, capsys):
    rc = main(["--model", tiny_llama, "--port", "0", "--pipeline_parallel_size", "0"])
    lines, (_, _, n_fail) = _report(capsys.readouterr().out)
    assert lines[0].startswith("flags FAILED --pipeline_parallel_size")
    assert any(line.startswith("memory ") for line in lines)
    assert n_fail >= 1 and rc == 1


def test_all_reduce_over_two_gloo_ranks():
    r = check_all_reduce(2, "gloo")
    assert r.status == PASS and "result correct" in r.detail, r


def test_memory_check_fails_when_available_memory_is_short(tiny_llama):
    cfg = EngineConfig.from_kwargs(model=tiny_llama, num_kv_blocks=64, block_size=16)
    ok = check_memory(cfg, available=1 << 30)
    assert ok.status == PASS and "64 KV blocks" in ok.detail
    assert check_memory(cfg, available=1000).status == FAILED
    bad = check_memory(EngineConfig.from_kwargs(model="/nonexistent/model"))
    assert bad.status == FAILED and "cannot read --model" in bad.detail
    huge = check_memory(EngineConfig.from_kwargs(model=tiny_llama, kv_cache_memory="99999TiB"))
    assert huge.status == FAILED and huge.detail.startswith("--kv_cache_memory: ")


def test_memory_check_counts_int8_kv_blocks_with_their_scales(tiny_llama):
    """--kv_cache_quant int8: the check sizes the pool from the engine's true bytes per block
    (tiny llama: 2 layers, 2 KV heads, head_dim 16 -> rows of 16 + 4 bytes)."""
    from bladellm.check.memory import model_memory

    kw = dict(model=tiny_llama, kv_cache_memory="1MiB", block_size=16, dtype="float32")
    _, fp_bytes, fp_desc = model_memory(EngineConfig.from_kwargs(**kw))
    _, q_bytes, q_desc = model_memory(EngineConfig.from_kwargs(kv_cache_quant="int8", **kw))
    per_block = 2 * 2 * 16 * 2 * (16 + 4)
    assert f"{(1 << 20) // per_block} KV blocks" in q_desc
    assert q_bytes == (1 << 20) // per_block * per_block
    assert f"{(1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)} KV blocks" in fp_desc


def test_available_memory_reads_meminfo():
    assert available_memory_bytes("MemTotal: 10 kB\nMemAvailable:    2048 kB\n") <= 2048 * 1024


def test_cpu_checks_on_faked_machines():
    old = CpuInfo("old", frozenset({"sse4_2"}), 1)
    r = check_cpu_isa(old)
    assert r.status == WARNING and "no AVX2" in r.detail and "float32" in r.detail
    avx512 = CpuInfo("x", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}), 8)
    assert "as float32" in check_cpu_isa(avx512).detail
    bf16 = CpuInfo("y", avx512.flags | {"avx512_bf16"}, 8)
    assert "as bfloat16" in check_cpu_isa(bf16).detail
    assert check_threads(old, None).status == WARNING  # one CPU for server and engine
    assert check_threads(avx512, 16).status == WARNING  # oversubscribed
    assert check_threads(avx512, 4).status == PASS
    assert check_shm("/nonexistent/shm").status == FAILED


def test_report_format_and_exit_code():
    results = [CheckResult("a", PASS, "fine"), CheckResult("b", WARNING, "hmm")]
    assert format_text(results).splitlines() == ["a PASS fine", "b WARNING hmm",
                                                 "PASS 1, WARNING 1, FAILED 0"]
    assert exit_code(results) == 0
    results.append(CheckResult("c", FAILED, "no"))
    assert exit_code(results) == 1 and json.loads(format_json(results))["ok"] is False
    with pytest.raises(ValueError):
        CheckResult("two words", PASS, "x")
    assert spread([100.0, 90.0]) == pytest.approx(0.1) and spread([5.0]) == 0.0


class _Props:
    def __init__(self, gib: int) -> None:
        self.total_memory = gib << 30


def _fake_gpus(monkeypatch, perf, triton="3.4.0"):
    """Two faked CUDA devices: the check's logic without a GPU (the measurement itself is
    covered by the gpu-marked test below)."""
    import torch

    from bladellm.check import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(perf))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake H{i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: _Props(80))
    monkeypatch.setattr(gpu, "_driver_version", lambda: "570.1")
    monkeypatch.setattr(gpu, "_triton_version", lambda: triton)

    def measure(i):
        if isinstance(perf[i], Exception):
            raise perf[i]
        return perf[i]

    monkeypatch.setattr(gpu, "measure_device", measure)
    return gpu


def test_gpu_checks_on_faked_devices(monkeypatch):
    gpu = _fake_gpus(monkeypatch, [(900e12, 3.0e12), (880e12, 2.9e12)])
    rows = {r.name: r for r in gpu.check_gpus("auto")}
    assert rows["gpu_devices"].status == PASS and "cuda:1 Fake H1 80 GiB" in rows["gpu_devices"].detail
    assert rows["gpu_software"].status == PASS and "driver 570.1" in rows["gpu_software"].detail
    assert rows["gpu0_perf"].detail.startswith("900.0 TFLOP/s") and "3000 GB/s" in rows["gpu0_perf"].detail
    assert rows["gpu_consistency"].status == PASS

    gpu = _fake_gpus(monkeypatch, [(900e12, 3.0e12), (600e12, 3.0e12)], triton=None)
    rows = {r.name: r for r in gpu.check_gpus("cuda")}
    assert rows["gpu_consistency"].status == WARNING and "33.3%" in rows["gpu_consistency"].detail
    assert rows["gpu_software"].status == WARNING and "need Triton" in rows["gpu_software"].detail

    gpu = _fake_gpus(monkeypatch, [(900e12, 3.0e12), RuntimeError("CUDA out of memory")])
    rows = {r.name: r for r in gpu.check_gpus("cuda")}
    assert rows["gpu1_perf"].status == FAILED and "out of memory" in rows["gpu1_perf"].detail
    assert "gpu_consistency" not in rows  # one measured device: nothing to compare


def test_no_gpu_fails_only_when_cuda_is_asked_for(monkeypatch):
    import torch

    from bladellm.check import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [r.status for r in gpu.check_gpus("auto")] == [PASS]
    assert [r.status for r in gpu.check_gpus("cuda")] == [FAILED]


@pytest.mark.gpu
def test_measure_device_on_a_real_gpu():
    import torch

    from bladellm.check import gpu

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    flops, bandwidth = gpu.measure_device(0, size=2048, iters=3)
    assert flops > 1e12 and bandwidth > 1e11
