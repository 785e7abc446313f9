"""Attention layer: hands q/k/v and the layer's features (sliding window, ALiBi slopes, logit
soft-capping; ``AttentionFeatures``) to the backend chosen once at startup."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bladellm.attention.backend import PLAIN, AttentionBackend, AttentionFeatures
from bladellm.checkpoint.attention_layout import layer_sliding_window, layer_types  # noqa: F401
from bladellm.kernels import ref
from bladellm.model.forward_context import ForwardContext


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 layer_idx: int, backend: AttentionBackend,
                 features: AttentionFeatures = PLAIN) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.backend = backend
        if features.alibi_slopes is not None and features.alibi_slopes.shape != (num_heads,):
            raise ValueError(f"ALiBi: {tuple(features.alibi_slopes.shape)} slopes for "
                             f"{num_heads} query heads")
        self.features = features

    @property
    def sliding_window(self) -> int | None:
        return self.features.sliding_window

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
            md = (ctx.attn_metadata if ctx.layer_attn_metadata is None
                  else ctx.layer_attn_metadata[self.layer_idx])
            out = self.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], md,
                                       self.scale, self.features)
        return out.reshape(T, self.num_heads * self.head_dim)

    def _causal_no_cache(self, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
        """All T tokens are one sequence (profiling / dummy run): no KV cache is touched."""
        if not self.features.is_plain:  # SDPA has no soft cap: the twin's scores, densely
            T = q.shape[0]
            group = self.num_heads // self.num_kv_heads
            scores = torch.einsum("qhd,khd->hqk", q.float(),
                                  k.float().repeat_interleave(group, dim=1)) * self.scale
            pos = torch.arange(T, device=q.device)
            scores = ref.attention_scores(scores, pos, pos, pos[None, :] <= pos[:, None],
                                          **self.features.kwargs())
            return torch.einsum("hqk,khd->qhd", scores.softmax(-1),
                                v.float().repeat_interleave(group, dim=1)).to(q.dtype)
        # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to the slow math kernel.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)
        return out[0].transpose(0, 1)


def layer_index(prefix: str) -> int:
    """The global decoder-layer index in a module prefix ``...layers.<i>...`` (a layer's
    ``layer_idx`` is its index within the pipeline stage, its KV cache's index)."""
    parts = prefix.split(".")
    for name, index in zip(parts, parts[1:]):
        if name == "layers" and index.isdigit():
            return int(index)
    raise ValueError(f"no layer index in module prefix {prefix!r}")


def alibi_slopes(total_num_heads: int) -> torch.Tensor:
    """ALiBi slopes for all heads (Press et al.; transformers' ``build_alibi_tensor``): a
    geometric series from 2^(-8/n) for the largest power of two n <= heads, the rest from the
    series of 2n taken at odd indices. Slice it per tensor-parallel rank."""
    closest = 2 ** math.floor(math.log2(total_num_heads))
    # fp32 powers, as transformers computes them, so the slopes match it bit for bit.
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != total_num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        num_rest = min(closest, total_num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * num_rest, 2,
                                                                  dtype=torch.int32))])
    return slopes
