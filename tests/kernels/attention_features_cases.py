"""Per-layer attention features for the kernel tests: the feature sets each kernel path must
honour, and batches whose blocks before every query's window hold NaN (as blocks the KV manager
freed for a window and another request reused may hold anything), so that a kernel reading them
fails the comparison."""

from __future__ import annotations

import torch

from bladellm.kernels import kv_int8, ref

from kernel_cases import PagedBatch, make_batch


def alibi(num_heads: int) -> torch.Tensor:
    """Bloom's slopes for ``num_heads`` (a non-power of two takes the interleaved extras)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    ones = torch.ones(1, 2)
    # build_alibi_tensor gives slope * position; at position 1 that is the slope.
    return build_alibi_tensor(ones, num_heads, torch.float32)[:, 0, 1].contiguous()


def feature_sets(num_heads: int) -> dict[str, dict]:
    return {
        "window": dict(sliding_window=13),
        "window1": dict(sliding_window=1),
        "softcap": dict(soft_cap=2.5),
        "alibi": dict(alibi_slopes=alibi(num_heads)),
        "window_softcap": dict(sliding_window=40, soft_cap=1.5),
        "window_alibi": dict(sliding_window=20, alibi_slopes=alibi(num_heads)),
    }


def poison_outside_window(b: PagedBatch, window: int | None, block_size: int) -> None:
    """Point each request's blocks wholly before its first query's window at a NaN block."""
    if window is None:
        return
    nan_block = b.k_cache.shape[0]  # a new last block, all NaN
    if kv_int8.is_int8(b.k_cache):  # int8 rows read back as value * NaN scale
        nan = torch.zeros_like(b.k_cache[:1])
        kv_int8.split(nan)[1].fill_(float("nan"))
    else:
        nan = torch.full_like(b.k_cache[:1], float("nan"))
    b.k_cache = torch.cat([b.k_cache, nan])
    b.v_cache = torch.cat([b.v_cache, nan])
    q_lens = (b.query_start_loc[1:] - b.query_start_loc[:-1]).tolist()
    for r, seq_len in enumerate(b.seq_lens.tolist()):
        first = ref.window_start(seq_len - q_lens[r], window) // block_size
        b.block_tables[r, :first] = nan_block


def batch(q_lens, seq_lens, nh, kvh, d, bs, dtype, window, seed=0) -> PagedBatch:
    b = make_batch(q_lens, seq_lens, nh, kvh, d, bs, dtype, seed=seed)
    poison_outside_window(b, window, bs)
    return b


def run(kernels, b: PagedBatch, scale: float, features: dict) -> torch.Tensor:
    out = torch.full(b.query.shape, float("nan"), dtype=b.query.dtype, device=b.query.device)
    kernels.paged_attention(out, b.query, b.k_cache, b.v_cache, b.block_tables,
                            b.query_start_loc, b.seq_lens, scale, **features)
    return out
