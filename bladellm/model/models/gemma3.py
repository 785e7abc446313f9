"""Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2's layout plus (1 + w) RMSNorms on q and k per
head before rotary, local (sliding) and global layers from ``layer_types`` /
``sliding_window_pattern`` with a rotary table each (the local one from
``rope_local_base_freq``, or the per-layer-type ``rope_parameters`` of transformers >= 5).
Attention logits are not soft-capped (transformers ignores ``attn_logit_softcapping`` here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from bladellm.attention.backend import AttentionFeatures
from bladellm.model.layers import RotaryEmbedding, UnitOffsetRMSNorm, get_rope
from bladellm.model.layers.attention import layer_sliding_window
from bladellm.model.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM


def rope_configs(cfg: Any) -> dict[str, Any]:
    """Per layer type, a config view whose rotary parameters are that type's."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):
        per_type = {kind: dict(params[kind]) for kind in ("full_attention", "sliding_attention")
                    if kind in params}
    else:  # older configs: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        per_type = {"sliding_attention": {"rope_type": "default",
                                          "rope_theta": getattr(cfg, "rope_local_base_freq",
                                                                10000.0)}}
        per_type["full_attention"] = None  # the config itself
    views = {}
    for kind, p in per_type.items():
        views[kind] = cfg if p is None else SimpleNamespace(
            rope_parameters=p, max_position_embeddings=cfg.max_position_embeddings)
    missing = {"full_attention", "sliding_attention"} - set(views)
    if missing:
        raise ValueError(f"config.json: rope_parameters has no entry for {sorted(missing)}")
    return views


class Gemma3Attention(Gemma2Attention):
    def __init__(self, cfg: Any, layer: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, layer, *args, **kwargs)
        self.attn.features = AttentionFeatures(sliding_window=layer_sliding_window(cfg, layer))
        dtype = self.qkv_proj.params_dtype
        self.q_norm = UnitOffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, params_dtype=dtype)
        self.k_norm = UnitOffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, params_dtype=dtype)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = q.shape[0]
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim)).view(T, self.q_size)
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim)).view(T, self.kv_size)
        return q, k


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def make_rotary(self, cfg: Any, dtype: torch.dtype) -> dict[str, RotaryEmbedding]:
        return {kind: get_rope(view, self.head_dim, dtype)
                for kind, view in rope_configs(cfg).items()}

    def make_attention(self, layer: int, kv_index: int, prefix: str) -> Gemma3Attention:
        kind = "sliding_attention" if layer_sliding_window(self.hf_config, layer) else \
            "full_attention"
        return Gemma3Attention(self.hf_config, layer, kv_index, self.rotary[kind],
                               self.attn_backend, self.dtype, self.quant_config, prefix)


__all__ = ["Gemma3ForCausalLM"]
