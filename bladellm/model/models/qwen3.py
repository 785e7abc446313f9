"""Qwen3: Llama layout plus a per-head RMSNorm on q and k before rotary; explicit head_dim."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers import RMSNorm
from bladellm.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, *args, **kwargs)
        dtype = self.qkv_proj.params_dtype
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, params_dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden, ctx).split([self.q_size, self.kv_size, self.kv_size],
                                                   dim=-1)
        T = q.shape[0]
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim)).view(T, self.q_size)
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)).view(T, self.kv_size)
        q, k = self.rotary_emb(positions, q, k, inplace=True)
        return self.o_proj(self.attn(q, k, v, ctx), ctx)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer_idx: int, prefix: str) -> nn.Module:
        qkv_bias, o_bias = self.attention_biases(self.hf_config)
        return Qwen3Attention(self.hf_config, layer_idx, self.rotary_emb, self.attn_backend,
                              self.dtype, self.quant_config, prefix, qkv_bias, o_bias)


__all__ = ["Qwen3ForCausalLM"]
