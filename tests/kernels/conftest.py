"""Shared fixtures: the compiled kernel set, built once per session into a temp cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bladellm.kernels import Kernels, load_kernels


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def compiled(kernel_cache) -> Kernels:
    """The compiled kernels for this machine. Where a compiler exists they must build: a
    silent fallback to the reference would make every comparison below trivially pass."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: only the reference kernels exist here")
    kernels = load_kernels(mode="auto", cache_root=kernel_cache)
    assert kernels.name == "compiled", "g++ exists but the kernels did not build"
    return kernels
