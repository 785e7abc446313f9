"""Adapter names cannot shadow the base model or a path; NaN/Inf adapters are refused;
--lora_modules names are unique (docs/lora.md, "Selecting an adapter")."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import httpx
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM  # noqa: E402
from test_lora_adapter import BASE, KEY, write  # noqa: E402

from bladellm.config import EngineConfig, LoRAConfig  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.entrypoints.api_server import build_app, check_lora_module_names  # noqa: E402
from bladellm.lora.adapter import LoRAError, load_adapter, validate_dir  # noqa: E402
from bladellm.lora.registry import LoRARegistry  # noqa: E402


HF = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, num_hidden_layers=2)  # = BASE


def registry(root, modules=None) -> LoRARegistry:
    cfg = LoRAConfig(enable_lora=True, lora_root=[str(root)], lora_modules=modules)
    return LoRARegistry(cfg, HF)


def client_for(reg):
    engine = FakeAsyncLLM()
    engine.lora_registry = reg
    app = build_app(engine, ServerConfig())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    for n in ("a1", "a2", "a4"):
        write(r / n, {})
    return r


async def test_load_under_base_name_or_path_like_name_is_400(root):
    reg = registry(root)
    async with client_for(reg) as c:
        for name in ("fake-model", f"{root}/a2", "sub/x", "..", "a2"):
            r = await c.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": f"{root}/a4"})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == "lora_name", r.text
        assert reg.adapters() == []
        # the adapter's own directory name under the root is the same adapter: fine
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a4",
                                                        "lora_path": f"{root}/a4"})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "plain",
                                                        "lora_path": f"{root}/a1"})
        assert r.status_code == 200, r.text
        # a path request still works, registered under its own string
        assert reg.resolve(f"{root}/a2").lora_path == os.path.realpath(f"{root}/a2")


def test_lora_modules_under_base_name_refused_at_startup(root, tmp_path):
    cfg = EngineConfig.from_kwargs(model="demo", enable_lora=True,
                                   lora_modules=[f"SmolLM2-135M-Instruct={root}/a1"])
    with pytest.raises(ValueError, match="--lora_modules"):
        check_lora_module_names(cfg, "SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="--lora_modules"):
        EngineConfig.from_kwargs(model="demo", enable_lora=True, served_model_name="m",
                                 lora_modules=[f"m={root}/a1"])
    reg = registry(root, [f"fake-model={root}/a1"])
    with pytest.raises(ValueError, match="--lora_modules"):
        client_for(reg)
    with pytest.raises(ValueError, match="--lora_modules x/y=.*plain name"):
        registry(root, [f"x/y={root}/a1"])


def test_duplicate_lora_modules_refused(root):
    with pytest.raises(ValueError, match="--lora_modules.*twice"):
        LoRAConfig(enable_lora=True, lora_modules=[f"a1={root}/a1", f"a1={root}/a2"])


async def test_embeddings_with_adapter_is_400_and_empty_model_names_model(root):
    reg = registry(root, [f"named={root}/a1"])
    async with client_for(reg) as c:
        r = await c.post("/v1/embeddings", json={"model": "named", "input": "hi"})
        assert r.status_code == 400 and "LoRA" in r.text and \
            r.json()["error"]["param"] == "model", r.text
        r = await c.post("/v1/completions", json={"model": "", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "lora_name" not in r.text


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_non_finite_weights_refused(tmp_path, bad, fmt):
    a = torch.ones(2, 8)
    a[1, 3] = bad
    path = write(tmp_path / "bad", {}, {KEY.format(0, "A"): a, KEY.format(0, "B"): torch.ones(8, 2)},
                 fmt=fmt)
    with pytest.raises(LoRAError, match="NaN or Inf"):
        validate_dir(path, 16, BASE)
    with pytest.raises(LoRAError, match="NaN or Inf"):
        load_adapter(path, 16, BASE, torch.float32)


async def test_non_finite_adapter_load_endpoint_is_400(root):
    b = torch.ones(8, 2)
    b[0, 0] = float("nan")
    write(root / "nan", {}, {KEY.format(0, "A"): torch.ones(2, 8), KEY.format(0, "B"): b})
    async with client_for(registry(root)) as c:
        r = await c.post("/v1/load_lora_adapter",
                         json={"lora_name": "n", "lora_path": f"{root}/nan"})
        assert r.status_code == 400 and "NaN" in r.text, r.text
