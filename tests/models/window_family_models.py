"""Tiny random Gemma 2, Gemma 3 (text) and Bloom models made with transformers, norm weights
and biases random too (as family_models.py does), windows smaller than the test prompts and
soft caps low enough to bite."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import train_tokenizer

COMMON = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
              bos_token_id=0, eos_token_id=2, pad_token_id=0)


def window_family_config(family: str, vocab_size: int, **overrides):
    import transformers

    if family == "gemma2":
        cfg = dict(COMMON, num_hidden_layers=2, intermediate_size=128, num_key_value_heads=2,
                   head_dim=16, initializer_range=0.2, rms_norm_eps=1e-6, sliding_window=8,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0, tie_word_embeddings=True)
        cls = transformers.Gemma2Config
    elif family == "gemma3":
        # layers 0, 1 local, 2 global (sliding_window_pattern 3), local rope base apart
        cfg = dict(COMMON, num_hidden_layers=3, intermediate_size=128, num_key_value_heads=2,
                   head_dim=16, initializer_range=0.2, rms_norm_eps=1e-6, sliding_window=8,
                   query_pre_attn_scalar=24, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0}})
        cls = transformers.Gemma3TextConfig
    elif family == "bloom":
        cfg = dict(COMMON, n_layer=2, n_head=COMMON["num_attention_heads"],
                   initializer_range=0.2, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                   apply_residual_connection_post_layernorm=False)
        cfg.pop("num_attention_heads")
        cfg.pop("max_position_embeddings")
        cls = transformers.BloomConfig
    else:
        raise ValueError(family)
    cfg.update(vocab_size=vocab_size, **overrides)
    config = cls(**cfg)
    if family == "gemma3":
        config.architectures = ["Gemma3ForCausalLM"]
    return config


@torch.no_grad()
def make_window_family_model(path: str | Path, family: str, seed: int = 0, **overrides) -> str:
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = window_family_config(family, len(tokenizer), **overrides)
    torch.manual_seed(seed)
    if family == "gemma3":
        model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if ("norm" in name or "ln_f" in name) and name.endswith("weight"):
            param.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
        elif name.endswith("bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    gen = {"bos_token_id": 0, "eos_token_id": [2], "pad_token_id": 0}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)
