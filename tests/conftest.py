import os
import sys

import pytest

# Triton kernels run under the interpreter where there is no GPU (tests/kernels/test_triton_*).
# Triton reads this when kernels are decorated, so it must be set before anything imports it.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Return a function (arch, **overrides) -> model dir, caching each variant per session."""
    cache: dict = {}

    def get(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(d, arch, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture
def fresh_cache_dir(tmp_path, monkeypatch):
    """``fresh_cache_dir(dir_var, switch_var)``: this test's own empty cache directory in
    ``dir_var`` (not created yet), with the cache's on/off switch ``switch_var`` at its default
    (on)."""
    def make(dir_var: str, switch_var: str):
        root = tmp_path / dir_var.lower()
        monkeypatch.setenv(dir_var, str(root))
        monkeypatch.delenv(switch_var, raising=False)
        return root

    return make


@pytest.fixture(scope="session", autouse=True)
def _caches_in_tmp(tmp_path_factory):
    """Dense copies of GGUF files (checkpoint/gguf_cache.py) and remembered configs and tokenizer
    classes (checkpoint/resolution_cache.py) go to per-session directories, never the user's cache;
    set in os.environ so server subprocesses inherit them."""
    names = ("BLADELLM_GGUF_CACHE_DIR", "BLADELLM_RESOLUTION_CACHE_DIR")
    old = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def layer_kernels():
    """The kernel set a CPU worker resolves for ``--kernels auto`` (the compiled kernels, or the
    reference where they cannot be built), handed to the layers and models this test builds
    directly (``kernels.scope.building_with``), as the worker hands it to its model."""
    from bladellm.kernels import resolve_kernels
    from bladellm.kernels.scope import building_with

    kernels = resolve_kernels("auto", "cpu")
    with building_with(kernels):
        yield kernels
