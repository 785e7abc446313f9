"""Attention layer: hands q/k/v to the backend chosen once at startup."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bladellm.attention.backend import AttentionBackend
from bladellm.model.forward_context import ForwardContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """q [T, nh*hd], k/v [T, nkv*hd] -> [T, nh*hd]."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if ctx.attn_metadata is None:
            out = self._causal_no_cache(q, k, v)
        else:
            out = self.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx],
                                       ctx.attn_metadata, self.scale)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _causal_no_cache(self, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
        """All T tokens are one sequence (profiling / dummy run): no KV cache is touched."""
        # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to the slow math kernel.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out[0].transpose(0, 1)
