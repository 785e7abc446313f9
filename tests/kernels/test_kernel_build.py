"""Building, caching and selecting the kernel set: the fallback to the reference, the cache
hit, the ``--kernels`` choices, one OpenMP runtime, and the other ISA builds."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess

import pytest
import torch

from bladellm import envs
from bladellm.kernels import Kernels, build, load_kernels, ref, resolve_kernels

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


def warnings_from_kernels(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name.startswith("bladellm.kernels") and r.levelno >= logging.WARNING]


def test_missing_compiler_gives_reference_and_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(build, "COMPILER", "no-such-compiler-bladellm")
    with caplog.at_level(logging.INFO, logger="bladellm.kernels"):
        kernels = load_kernels(mode="auto", cache_root=tmp_path, isa="avx2")
    assert type(kernels) is Kernels and kernels.name == "ref"
    [warning] = warnings_from_kernels(caplog)
    assert "no-such-compiler-bladellm" in warning.getMessage()
    x = torch.randn(3, 8)
    assert torch.equal(kernels.rms_norm(x, torch.ones(8), 1e-6), ref.rms_norm(x, torch.ones(8),
                                                                            1e-6))


def test_failing_compiler_gives_reference_and_one_warning(monkeypatch, tmp_path, caplog):
    fake = tmp_path / "broken-g++"
    fake.write_text("#!/bin/sh\necho 'internal compiler error' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(build, "COMPILER", str(fake))
    with caplog.at_level(logging.INFO, logger="bladellm.kernels"):
        kernels = load_kernels(mode="auto", cache_root=tmp_path / "cache", isa="avx2")
    assert kernels.name == "ref"
    [warning] = warnings_from_kernels(caplog)
    assert "internal compiler error" in warning.getMessage()
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind


def test_second_load_is_a_cache_hit_without_the_compiler(compiled, kernel_cache, monkeypatch,
                                                         caplog):
    """``compiled`` built the library into ``kernel_cache``; loading it again must not run the
    compiler at all (the key is computed from file contents and the compiler's file stat)."""
    if os.environ.get("BLADELLM_TEST_EMULATE_ISA"):
        pytest.skip("the emulated build's flags are not the ISA's own (conftest.py)")

    def no_compiler(*args, **kwargs):
        raise AssertionError(f"compiler invoked on a cache hit: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_compiler)
    again = build.build_library(compiled.isa, kernel_cache)
    assert again.cache_hit  # Popen raises above, so nothing was compiled (no timing here:
    # a loaded CI machine took 0.6 s to hash the sources and dlopen)
    assert [p.name for p in (kernel_cache / "kernels").glob("*.so")] == [again.path.name]
    with caplog.at_level(logging.INFO, logger="bladellm.kernels"):
        kernels = load_kernels(mode="auto", cache_root=kernel_cache)
    assert kernels.name == "compiled" and kernels.isa == compiled.isa
    [line] = [r.getMessage() for r in caplog.records if r.name == "bladellm.kernels"]
    assert line.startswith(f"CPU kernels: compiled {compiled.isa} (cache hit")


def test_cache_key_separates_isas_and_compilers():
    keys = {build.cache_key(isa, "g++:1", "") for isa in build.ISA_FLAGS}
    assert len(keys) == len(build.ISA_FLAGS)
    assert build.cache_key("avx2", "g++:1", "") != build.cache_key("avx2", "g++:2", "")
    assert build.cache_key("avx2", "g++:1", "") == build.cache_key("avx2", "g++:1", "")


def test_ref_selects_reference_without_building(monkeypatch):
    """``--kernels ref``: the reference set, nothing compiled."""
    def no_build(*args, **kwargs):
        raise AssertionError("built despite --kernels ref")

    monkeypatch.setattr("bladellm.kernels.build_library", no_build)
    assert load_kernels("ref").name == "ref"
    assert resolve_kernels("ref", "cpu").name == "ref"


def test_kernels_mode_validated_and_cache_dir_default(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="--kernels"):
        load_kernels("fast")
    with pytest.raises(ValueError, match="--kernels"):
        resolve_kernels("fast", "cpu")
    monkeypatch.delenv("BLADELLM_CACHE_DIR", raising=False)
    assert envs.cache_dir().parts[-2:] == (".cache", "bladellm")
    monkeypatch.setenv("BLADELLM_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == tmp_path


def test_compiled_that_cannot_build_is_an_error_naming_the_flag(monkeypatch, tmp_path):
    """``--kernels compiled`` asks for the compiled set: no silent fallback to the reference."""
    monkeypatch.setattr(build, "COMPILER", "no-such-compiler-bladellm")
    with pytest.raises(ValueError, match="--kernels compiled"):
        load_kernels("compiled", cache_root=tmp_path, isa="avx2")


def test_resolve_follows_the_device_and_the_attention_backend(monkeypatch):
    """``auto``: the CPU set on a CPU, the Triton set on CUDA or when an attention backend asks
    for triton; the compiled set is for CPUs only; Triton off CUDA needs the interpreter."""
    assert resolve_kernels("auto", "cpu").name in ("compiled", "ref")
    assert resolve_kernels("auto", "cpu") is resolve_kernels("auto", "cpu")  # one build, shared
    with pytest.raises(ValueError, match="--kernels compiled.*cuda"):
        resolve_kernels("compiled", "cuda")
    pytest.importorskip("triton")
    assert resolve_kernels("auto", "cuda").name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("auto", "cpu", ("auto", "triton")).name == "triton"
    assert resolve_kernels("triton", "cpu").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="--attn_cls triton.*TRITON_INTERPRET"):
        resolve_kernels("auto", "cpu", ("triton",))
    with pytest.raises(ValueError, match="--kernels triton.*TRITON_INTERPRET"):
        resolve_kernels("triton", "cpu")


def test_one_openmp_runtime(compiled):
    """The library links the OpenMP runtime torch loaded: never a second thread pool."""
    runtimes = build.loaded_openmp_runtimes()
    assert len(runtimes) <= 1, runtimes


def test_kernels_survive_deepcopy(compiled):
    import copy

    assert copy.deepcopy(compiled) is compiled
    assert copy.deepcopy(Kernels()).name == "ref"


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_other_isa_builds_match_reference(tmp_path, isa):
    """The 8-lane (AVX2) and 4-lane (SSE) builds, run here where the CPU is a superset: what
    AVX2-only CI machines and other CPUs run by default."""
    if isa == "avx2" and not {"avx2", "fma"} <= set(open("/proc/cpuinfo").read().split()):
        pytest.skip("CPU without AVX2")
    from kernel_cases import make_batch

    kernels = load_kernels(mode="auto", cache_root=tmp_path, isa=isa)
    assert kernels.name == "compiled" and kernels.lanes == {"avx2": 8, "generic": 4}[isa]
    for dtype in (torch.float32, torch.bfloat16):
        batch = make_batch([1, 4, 40, 1], [1, 33, 90, 600], 12, 4, 64, 16, dtype)
        torch.testing.assert_close(batch.run(kernels, 0.125), batch.run(Kernels(), 0.125),
                                   atol=2e-5 if dtype == torch.float32 else 1.6e-2,
                                   rtol=2e-5 if dtype == torch.float32 else 1.6e-2)
        x = torch.randn(5, 2 * 100).to(dtype)
        w = torch.randn(100).to(dtype)
        assert torch.equal(kernels.rms_norm(x[:, :100], w, 1e-6), ref.rms_norm(x[:, :100], w,
                                                                               1e-6))
        assert torch.equal(kernels.silu_and_mul(x), ref.silu_and_mul(x))


def test_prune_keeps_the_newest_builds_of_one_isa(tmp_path):
    for i in range(build.KEEP_BUILDS + 3):
        lib = tmp_path / f"cpu-avx2-{i:04d}.so"
        lib.write_bytes(b"")
        os.utime(lib, (i, i))
    (tmp_path / "cpu-avx2_x-0000.so").write_bytes(b"")  # another ISA's: untouched
    build._prune(tmp_path / f"cpu-avx2-{build.KEEP_BUILDS + 2:04d}.so")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["cpu-avx2-0003.so", *[f"cpu-avx2-{i:04d}.so" for i in range(4, 11)],
                    "cpu-avx2_x-0000.so"]


@needs_compiler
@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2"])
def test_every_isa_builds(compiled, tmp_path, isa):
    """Each ISA's library compiles and links on any machine, also one whose CPU cannot run it:
    an error in an AVX-512 branch must fail here, not turn those machines' kernels into the
    reference with a warning. (The ``amx`` build uses ``avx512_bf16``'s flags.)"""
    from bladellm.platforms.cpu import detect_cpu

    if isa == detect_cpu().isa:
        pytest.skip("this machine's build: the compiled fixture built and loaded it")
    assert build.ISA_FLAGS["amx"] == build.ISA_FLAGS["avx512_bf16"]
    compiler, _ = build._compiler_identity(build.COMPILER)
    target = tmp_path / f"cpu-{isa}.so"
    build._compile(compiler, isa, None, target)
    assert target.stat().st_size > 0
