"""Attention of look_ahead's tree tokens, fast path (PyTorch; the reference twin and test oracle
is ``kernels.ref.tree_attention``).

A tree request's K/V for this step were stored by ``reshape_and_cache`` in its own slots right
after its context (positions ``ctx_len .. ctx_len + t - 1``), so one gather of ``ctx_len + t``
cache rows gives context and tree keys together; no concatenation. The query heads sharing a KV
head are folded into one matrix (``[kv_heads, t * G, d]``) so that scores and the weighted sum
are two batched GEMMs per layer, without expanding K/V per query head. The mask becomes an
additive bias ``[t * G, ctx_len + t]`` built once per step and shared by every layer.
The reference path's gather, ``cat``, GQA ``repeat_interleave`` and SDPA math kernel, which this
path avoids, were a large share of a tree step when profiled (docs/kernels.md).
"""

from __future__ import annotations

import torch

from bladellm.kernels import kv_int8, ref


def tree_bias(mask: torch.Tensor, ctx_len: int, group: int) -> torch.Tensor:
    """Additive float32 bias ``[t * group, ctx_len + t]``: 0 where row token sees the key, -inf
    where not; rows ordered (token, head in group)."""
    t = mask.shape[0]
    bias = torch.zeros((t, ctx_len + t), dtype=torch.float32)
    bias[:, ctx_len:].masked_fill_(~mask, float("-inf"))
    return bias.repeat_interleave(group, dim=0)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   ctx_len: int, bias: torch.Tensor, scale: float, *,
                   sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                   soft_cap: float | None = None) -> torch.Tensor:
    """Same contract as ``ref.tree_attention`` with the mask given as ``tree_bias(...)``; the
    tree's K/V (``key``/``value``) must already be in the cache after position ``ctx_len``
    (``reshape_and_cache`` put them there), so they are read back like the context: from an
    int8 cache, quantized, as the causal kernel and a plain decode read them. The per-layer
    features apply as in the twin; with a window, blocks before it are not read."""
    block_size, num_kv_heads, row = k_cache.shape[1:]
    t, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    total = ctx_len + t
    first_block = min(ref.window_start(ctx_len, sliding_window), ctx_len) // block_size
    key0 = first_block * block_size
    blocks = block_table[first_block:-(-total // block_size)].long()
    k = kv_int8.to_float(
        k_cache.index_select(0, blocks).view(-1, num_kv_heads, row)[:total - key0])
    v = kv_int8.to_float(
        v_cache.index_select(0, blocks).view(-1, num_kv_heads, row)[:total - key0])
    q = query.float().view(t, num_kv_heads, group, head_dim).transpose(0, 1)
    q = q.reshape(num_kv_heads, t * group, head_dim)
    bias = bias[:, key0:]
    if sliding_window is None and alibi_slopes is None and soft_cap is None:
        scores = torch.baddbmm(bias, q, k.permute(1, 2, 0), alpha=scale)  # [kvh, t*G, keys]
    else:
        scores = torch.bmm(q, k.permute(1, 2, 0)) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        mask = bias[::group, ctx_len - key0:] == 0  # [t, t]: the tree mask back
        q_pos = ref.tree_positions(mask, ctx_len)
        k_pos = torch.cat([torch.arange(key0, ctx_len), q_pos])
        rel = (k_pos[None, :] - q_pos[:, None]).float()  # [t, keys]
        extra = torch.zeros((num_kv_heads, t, group, rel.shape[1]))
        if alibi_slopes is not None:
            slopes = alibi_slopes.float().view(num_kv_heads, 1, group, 1)
            extra = extra + slopes * rel[None, :, None, :]
        if sliding_window is not None:
            extra.masked_fill_((rel <= -sliding_window)[None, :, None, :], float("-inf"))
        scores = scores + extra.view(num_kv_heads, t * group, -1) + bias
    out = torch.bmm(scores.softmax(-1), v.transpose(0, 1))  # [kvh, t*G, d]
    return out.view(num_kv_heads, t, group, head_dim).transpose(0, 1).reshape(
        t, num_heads, head_dim)
