from __future__ import annotations

import json
import os

import pytest
import torch

from tiny_models import CORPUS, make_tiny_model


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: a second thread only adds synchronization (10x slower on a busy box)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(CORPUS[:10] * 4))
    return str(path)


@pytest.fixture(scope="session")
def outlier_llama(tmp_path_factory) -> str:
    """A tiny llama whose RMSNorm weights blow up a few channels, as real LLMs' activations
    have outlier channels (what SmoothQuant and AWQ exploit)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-outlier"), "llama", seed=1)
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    gen = torch.Generator().manual_seed(3)
    for name, t in state.items():
        if name.endswith("layernorm.weight"):
            idx = torch.randperm(t.numel(), generator=gen)[:4]
            t[idx] *= 25.0
    save_file(state, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    return path
