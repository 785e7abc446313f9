"""PEFT adapter checks: what is served, and the clear reason for what is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from bladellm.lora.adapter import BaseShapes, LoRAError, load_adapter, validate_dir

BASE = BaseShapes(2, {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8),
                      "gate_proj": (8, 16), "up_proj": (8, 16), "down_proj": (16, 8)})
KEY = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"


def write(path, config: dict, tensors: dict | None = None, fmt: str = "safetensors") -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    cfg.update(config)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    if tensors is None:
        tensors = {KEY.format(0, "A"): torch.ones(2, 8), KEY.format(0, "B"): torch.ones(8, 2)}
    if fmt == "safetensors":
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    else:
        torch.save(tensors, os.path.join(path, "adapter_model.bin"))
    return str(path)


def test_loads_scaled_weights_from_safetensors_and_bin(tmp_path):
    for fmt, cfg, scale in [("safetensors", {}, 2.0), ("bin", {"use_rslora": True}, 4 / 2**0.5)]:
        w = load_adapter(write(tmp_path / fmt, cfg, fmt=fmt), 16, BASE, torch.float32)
        a, b = w.modules[(0, "q_proj")]
        assert w.rank == 2 and a.shape == (2, 8)
        torch.testing.assert_close(b, torch.full((8, 2), scale))


@pytest.mark.parametrize("config,tensors,reason", [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["embed_tokens"]}, None, "embedding / LM-head"),
    ({"target_modules": ["lm_head", "q_proj"]}, None, "embedding / LM-head"),
    ({"target_modules": ["fc1"]}, None, "not supported"),
    ({"r": 32}, None, "exceeds --max_lora_rank 16"),
    ({"bias": "all"}, None, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, None, "rank_pattern"),
    ({"peft_type": "IA3"}, None, "peft_type"),
    ({}, {KEY.format(0, "A"): torch.ones(2, 9), KEY.format(0, "B"): torch.ones(8, 2)},
     "does not fit the base model"),
    ({}, {KEY.format(5, "A"): torch.ones(2, 8), KEY.format(5, "B"): torch.ones(8, 2)},
     "2 layers"),
    ({}, {KEY.format(0, "A"): torch.ones(2, 8)}, "without its pair"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 8)},
     "embedding / LM-head"),
    ({}, {KEY.format(0, "A"): torch.ones(2, 8), KEY.format(0, "B"): torch.ones(8, 2),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
          torch.ones(8)}, "DoRA"),
])
def test_refused_with_reason(tmp_path, config, tensors, reason):
    path = write(tmp_path / "a", config, tensors)
    with pytest.raises(LoRAError, match=reason):
        validate_dir(path, 16, BASE)
    with pytest.raises(LoRAError, match=reason):
        load_adapter(path, 16, BASE, torch.float32)


def test_not_an_adapter_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        validate_dir(str(tmp_path), 16, BASE)
