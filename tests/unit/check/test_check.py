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
    assert "KV cache 100000.00 GiB" in by_name["memory"]["detail"]
    assert by_name[f"port_{port}"]["status"] == FAILED
    assert report["summary"][FAILED] == 2 and report["ok"] is False and rc == 1


def test_flags_the_engine_rejects_fail_but_the_rest_still_runs(tiny_llama, capsys):
    rc = main(["--model", tiny_llama, "--port", "0", "--pipeline_parallel_size", "2"])
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
