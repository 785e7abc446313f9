"""Shared fixtures: the compiled kernel set, built once per session into a temp cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bladellm.kernels import Kernels, build, load_kernels

# BLADELLM_TEST_EMULATE_ISA=avx512 | avx512_bf16 runs every compiled-kernel test against that
# build with its intrinsics emulated by SIMDe (https://github.com/simd-everywhere/simde; Debian's
# libsimde-dev, or BLADELLM_TEST_SIMDE_INCLUDE=<dir holding simde/>): the AVX-512 sources get
# tested on an AVX2 machine. Correctness only; emulated code is far slower than native.
EMULATED_ISA_MACROS = {"avx512": ["-D__AVX512F__"],
                       "avx512_bf16": ["-D__AVX512F__", "-D__AVX512BF16__"]}
SIMDE_SHIM = Path(__file__).parent / "simde_shim"


def _emulated_flags(isa: str) -> list[str]:
    if isa not in EMULATED_ISA_MACROS:
        raise pytest.UsageError(f"BLADELLM_TEST_EMULATE_ISA={isa!r}: one of "
                                f"{sorted(EMULATED_ISA_MACROS)}")
    include = Path(os.environ.get("BLADELLM_TEST_SIMDE_INCLUDE", "/usr/include"))
    if not (include / "simde" / "x86" / "avx512.h").exists():
        raise pytest.UsageError(f"BLADELLM_TEST_EMULATE_ISA needs SIMDe headers: no "
                                f"{include}/simde/x86/avx512.h (set BLADELLM_TEST_SIMDE_INCLUDE)")
    # AVX2 code for everything SIMDe does not emulate; SIMDE_NO_NATIVE keeps it from calling
    # the (absent) native AVX-512 instructions because the macros say they exist.
    return ["-march=x86-64-v3", *EMULATED_ISA_MACROS[isa], "-DSIMDE_NO_NATIVE",
            f"-I{SIMDE_SHIM}", f"-I{include}"]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def compiled(kernel_cache) -> Kernels:
    """The compiled kernels for this machine. Where a compiler exists they must build: a
    silent fallback to the reference would make every comparison below trivially pass."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: only the reference kernels exist here")
    isa = os.environ.get("BLADELLM_TEST_EMULATE_ISA")
    if isa:
        with pytest.MonkeyPatch.context() as mp:  # the flags are read only while building
            mp.setitem(build.ISA_FLAGS, isa, _emulated_flags(isa))
            kernels = load_kernels(mode="auto", cache_root=kernel_cache, isa=isa)
        assert kernels.name == "compiled" and kernels.lanes == 16, "not the emulated build"
        assert kernels.linear_dpbf16 == (isa == "avx512_bf16")
    else:
        kernels = load_kernels(mode="auto", cache_root=kernel_cache)
    assert kernels.name == "compiled", "g++ exists but the kernels did not build"
    return kernels
