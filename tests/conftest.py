import os
import sys

import pytest

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
