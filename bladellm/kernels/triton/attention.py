"""GPU paged attention in Triton: one kernel for the whole flat batch, whatever each request's
query length (decode 1, speculative verification 1 + k, a prefill chunk after a cached prefix).

The contract is the twin's, ``bladellm.kernels.ref.paged_attention`` (attention/backend.py has
the layout): request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` (q_len >= 0;
0 is a padding request and writes nothing), its context is ``seq_lens[r]`` tokens including
those, so query j sits at position ``seq_len - q_len + j`` and sees keys ``0..position``. Caches
are ``[num_blocks, block_size, kvh, d]`` (one half of the engine's ``[2, ...]`` layer tensor);
position p lives in block ``block_tables[r, p // block_size]`` at offset ``p % block_size``.

One program per (request, query tile, KV head, key split). Its rows are ``BLOCK_Q`` query
tokens x the ``group = nh / kvh`` query heads that share the KV head (padded to a power of two),
so a K/V tile is read once for the whole GQA group and the dot products have at least 16 rows
(tensor cores) even for decode. One split by default; more (flash decoding) add a merge
kernel. KV tiles of ``BLOCK_N`` positions are gathered in place through the block table (per
position, so ``BLOCK_N`` and ``block_size`` are independent); scores, the online softmax and
the accumulator are fp32; the output is rounded to ``out.dtype`` once. The loop stops at the
last key the tile's last query can see. An int8 cache (``--kv_cache_quant int8``, rows of
``head_dim`` int8 values + their fp32 scale, ``kernels/kv_int8.py``) is dequantized as tiles are
read.

Dots take 16-bit q/k/v as they are (fp32 accumulation; the probabilities are rounded to v's
dtype for the P @ V dot, as flash attention does) and fp32 in IEEE precision (not TF32). Under
``TRITON_INTERPRET=1`` bfloat16 dots are computed on fp32 copies: the interpreter's bf16
arithmetic is wrong (numpy has no bf16), so that GPU path is only checked on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bladellm.kernels import kv_int8
from bladellm.kernels.triton import INTERPRETING

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
        seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale_log2, num_heads, head_dim,
        block_size, partition, window, cap_log2, alibi_ptr,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_cb, stride_cs, stride_ch,
        stride_bt,
        GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # cached tokens before this step's queries

    ROWS: tl.constexpr = BLOCK_Q * GROUP_P2
    rows = tl.arange(0, ROWS)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_P2  # query token within the request
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_idx < q_len) & (rows % GROUP_P2 < GROUP)
    q_pos = context_len + q_idx
    dims = tl.arange(0, HEAD_DIM)
    dim_ok = dims < head_dim

    q = tl.load(q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_qt
                + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # A finite floor for the running max: rows with nothing visible yet (masked rows, or a
    # tile entirely in a row's future) keep exp2(-inf - m) = 0 instead of NaN.
    m_i = tl.full((ROWS,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)

    # Keys past the tile's last query position are in every row's future. With splits, this
    # program takes keys [split * partition, (split + 1) * partition) of them (maybe none).
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    n_start = split * partition
    if HAS_ALIBI:  # slope per row's head, in log2 units
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
    n_end = tl.minimum(kv_end, n_start + partition)
    if HAS_WINDOW:  # keys before the tile's first query's window are never read
        n_start = tl.maximum(n_start, context_len + q_tile * BLOCK_Q - window + 1)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(n_start, n_end, BLOCK_N):
        k_pos = n0 + offs_n
        k_ok = k_pos < n_end
        block = tl.load(block_tables_ptr + req * stride_bt + k_pos // block_size,
                        mask=k_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (k_pos % block_size) * stride_cs + kv_head * stride_ch
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if KV_INT8:  # the row's fp32 scale sits right after its head_dim int8 values
            k_scale = tl.load((k_cache_ptr + slot + head_dim).to(tl.pointer_type(tl.float32)),
                              mask=k_ok, other=0.0)
            v_scale = tl.load((v_cache_ptr + slot + head_dim).to(tl.pointer_type(tl.float32)),
                              mask=k_ok, other=0.0)
            k = k.to(tl.float32) * k_scale[:, None]
            v = v.to(tl.float32) * v_scale[:, None]
        elif DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, BLOCK_N]
        if HAS_CAP:  # cap * tanh(s / cap) in log2 units: tanh(y) = 1 - 2 / (e^(2y) + 1)
            e2y = tl.exp2(s * (2.0 / cap_log2) * 1.4426950408889634)
            s = cap_log2 * (1.0 - 2.0 / (e2y + 1.0))
        if HAS_ALIBI:
            s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    token = (q_start + q_idx).to(tl.int64)
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:  # this split's running max (log2 domain), sum and unnormalised sum, for the merge
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, num_heads, head_dim,
                         stride_ot, stride_oh, NUM_SPLITS: tl.constexpr,
                         SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One (token, head): the splits' partial softmaxes rescaled to their common max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, HEAD_DIM)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    ok = splits < NUM_SPLITS
    m = tl.load(part_m_ptr + part, mask=ok, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    # Only splits that saw a key wrote their accumulator (the workspace is not zeroed).
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=(ok & (l_s > 0))[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # a split that saw no key: m = -1e30, weight 0
    total = tl.sum(l_s * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             o.to(out_ptr.dtype.element_ty), mask=dims < tl.where(total > 0, head_dim, 0))


def _check(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("query must be [T, nh, d] and the caches [num_blocks, block_size, "
                         "kvh, d] of one shape")
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} must have query's shape {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    int8 = kv_int8.is_int8(k_cache)
    row = kv_int8.row_width(head_dim) if int8 else head_dim
    if k_cache.shape[3] != row or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of {head_dim} do not fit a cache of "
                         f"{num_kv_heads} KV heads of rows {k_cache.shape[3]}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16) \
            or v_cache.dtype != k_cache.dtype or (k_cache.dtype != query.dtype and not int8):
        raise ValueError(f"the caches must have query's float dtype or be int8, got "
                         f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if int8:
        kv_int8.check_head_dim(head_dim)
    if query.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 \
            or k_cache.stride() != v_cache.stride() or block_tables.stride(1) != 1:
        raise ValueError("the head dimension (and block table rows) must be contiguous")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_tables.shape[0] < num_reqs:
        raise ValueError(f"query_start_loc must be [num_reqs + 1] and block_tables have a row "
                         f"per request ({num_reqs})")


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    *, max_query_len: int | None = None, block_q: int | None = None,
                    block_n: int = 32, num_splits: int = 1,
                    max_seq_len: int | None = None, sliding_window: int | None = None,
                    alibi_slopes: torch.Tensor | None = None,
                    soft_cap: float | None = None) -> None:
    """Into ``out [T, nh, d]``, as ``ref.paged_attention``. ``max_query_len``: the longest
    request's query (AttentionMetadata has it); None reads it from ``query_start_loc``, a host
    sync. ``block_q`` query tokens per program (default: enough for 64 rows with the GQA group,
    at most the longest query); ``block_n`` keys per KV tile. Tiles below 16 are raised to 16
    (the GPU dot's minimum).

    ``num_splits > 1`` (flash decoding): each program takes one of ``num_splits`` equal key
    ranges of the longest context (``max_seq_len``, read from ``seq_lens`` when None), and a
    second kernel merges their partial softmaxes, so that a small decode batch over long
    contexts still fills the GPU. Costs fp32 workspace of ``T * nh * num_splits * (d + 2)``.

    Per-layer features as the twin's: ``sliding_window`` (keys before a tile's first window are
    not read), ``alibi_slopes`` [nh], ``soft_cap``."""
    _check(out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or query.shape[0] == 0:
        return
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    if block_q is None:
        block_q = min(max(1, 64 // group_p2), triton.next_power_of_2(max_query_len))
    block_q = triton.next_power_of_2(max(block_q, triton.cdiv(16, group_p2)))
    block_n = max(16, triton.next_power_of_2(block_n))
    # fp32 dots in IEEE precision (the default on NVIDIA would be TF32); 16-bit dots take the
    # backend's default (None), which every backend accepts.
    # An int8 cache is dequantized to fp32 (the twin's values), so its dots are fp32 too.
    int8 = kv_int8.is_int8(k_cache)
    dot_fp32 = (query.dtype == torch.float32 or int8
                or (INTERPRETING and query.dtype == torch.bfloat16))
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    num_tokens = query.shape[0]
    if num_splits > 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
        # Rows no request owns stay at l = 0, and the merge leaves them alone, as the twin does.
        part_m = torch.full((num_tokens, num_heads, num_splits), -1.0e30, dtype=torch.float32,
                            device=query.device)
        part_l = torch.zeros_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_p2,
                               dtype=torch.float32, device=query.device)
    else:
        partition = 1 << 30  # one range: every key
        part_m = part_l = part_acc = out  # not touched with one split
    if alibi_slopes is not None:
        if alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must be [{num_heads}], got "
                             f"{tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).contiguous()
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        part_m, part_l, part_acc, scale * _LOG2E, num_heads, head_dim, k_cache.shape[1],
        partition, sliding_window or 0, (soft_cap or 0.0) * _LOG2E,
        alibi_slopes if alibi_slopes is not None else seq_lens,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim_p2, KV_INT8=int8, DOT_FP32=dot_fp32,
        PRECISION="ieee" if dot_fp32 else None, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
        HAS_ALIBI=alibi_slopes is not None)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_heads, head_dim, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim_p2)
