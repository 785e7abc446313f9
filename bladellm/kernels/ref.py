"""Plain-PyTorch twins of every kernel: the semantics the compiled kernels must reproduce, and
the path taken wherever those cannot run (no compiler, float16, GPU tensors, odd shapes).

Shapes: T tokens, nh query heads, kvh KV heads (nh a multiple of kvh), d head dim; caches are
[num_blocks, block_size, kvh, d] in a float dtype, or int8 [num_blocks, block_size, kvh, d + 4]
(``--kv_cache_quant int8``: each row quantized with its own scale, see ``kv_int8.py``); readers
dequantize only the blocks they gather.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bladellm.kernels import kv_int8


def attention_scores(scores: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     visible: torch.Tensor, *, sliding_window: int | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """The per-layer attention features on fp32 ``scores [h, q, k]`` (already times the softmax
    scale), in transformers' order: soft-capping ``cap * tanh(s / cap)`` (Gemma 2), then ALiBi
    ``+ slope[h] * (k_pos - q_pos)`` (Bloom; equal under softmax to transformers'
    ``slope * k_pos``), then the mask: ``visible [q, k]`` (causal or a tree) and, with a
    window, only keys with ``q_pos - k_pos < sliding_window`` (transformers'
    ``kv_idx > q_idx - sliding_window``)."""
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    rel = (k_pos[None, :] - q_pos[:, None]).float()
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float().to(scores.device)[:, None, None] * rel
    if sliding_window is not None:
        visible = visible & (rel > -sliding_window)
    return scores.masked_fill(~visible, float("-inf"))


def window_start(first_pos: int, sliding_window: int | None) -> int:
    """First key position any query at ``first_pos`` or later can see."""
    return 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, sliding_window: int | None = None,
                    alibi_slopes: torch.Tensor | None = None,
                    soft_cap: float | None = None) -> None:
    """Causal attention of each request's query tokens over its paged context, into ``out``.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` (q_len >= 1); its
    context is ``seq_lens[r]`` tokens (this step's included, already in the cache), so query j
    sits at position ``seq_len - q_len + j`` and sees keys ``0..position``. Scores and softmax
    in fp32; the output is rounded to ``out.dtype`` once. An int8 cache is read as
    ``q * scale`` in fp32.

    Per-layer features (``attention_scores``): ``sliding_window`` (a query sees only its last
    ``sliding_window`` keys, itself included; blocks wholly before the first query's window are
    never read, so the KV manager may have freed them), ``alibi_slopes`` [nh] fp32,
    ``soft_cap`` (tanh logit cap).
    """
    block_size, num_kv_heads, row = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        begin, end = starts[r], starts[r + 1]
        q_len = end - begin
        first_block = window_start(seq_len - q_len, sliding_window) // block_size
        key0 = first_block * block_size
        blocks = block_tables[r, first_block:-(-seq_len // block_size)].long()
        k = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, row)[:seq_len - key0]
        v = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, row)[:seq_len - key0]
        k = kv_int8.to_float(k).repeat_interleave(group, dim=1)  # [L, nh, d]
        v = kv_int8.to_float(v).repeat_interleave(group, dim=1)
        q = query[begin:end].float()  # [Q, nh, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(key0, seq_len, device=q.device)
        scores = attention_scores(scores, positions, k_pos, k_pos[None, :] <= positions[:, None],
                                  sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                                  soft_cap=soft_cap)
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)


def tree_positions(mask: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Positions of tree tokens: ``ctx_len`` + depth, a token's depth being the number of
    tokens it sees in the tree other than itself (its ancestors)."""
    return ctx_len + mask.sum(-1).long() - 1


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   ctx_len: int, mask: torch.Tensor, scale: float, *,
                   sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                   soft_cap: float | None = None) -> torch.Tensor:
    """Attention of ``t`` tree tokens (query/key/value [t, heads, d]) over a request's first
    ``ctx_len`` cached positions (all visible) and over each other where ``mask [t, t]`` is
    True (the diagonal included). fp32 scores and softmax; returns [t, nh, d] float32. With an
    int8 cache the tree's own K/V are taken as the cache gives them back (quantized), like
    every other token's: verification then sees what a plain decode of the same tokens would
    see. The features apply as in ``paged_attention`` with tree token positions
    ``tree_positions`` (context key p at position p)."""
    block_size, num_kv_heads, row = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    first_block = min(window_start(ctx_len, sliding_window), ctx_len) // block_size
    key0 = first_block * block_size
    blocks = block_table[first_block:-(-ctx_len // block_size)].long()
    k = k_cache.index_select(0, blocks).reshape(-1, num_kv_heads, row)[:ctx_len - key0]
    v = v_cache.index_select(0, blocks).reshape(-1, num_kv_heads, row)[:ctx_len - key0]
    key, value = kv_int8.round_trip(key, k_cache), kv_int8.round_trip(value, v_cache)
    k = torch.cat([kv_int8.to_float(k), key.float()]).repeat_interleave(group, dim=1)
    v = torch.cat([kv_int8.to_float(v), value.float()]).repeat_interleave(group, dim=1)
    t = query.shape[0]
    q_pos = tree_positions(mask, ctx_len)
    k_pos = torch.cat([torch.arange(key0, ctx_len), q_pos])
    visible = torch.cat([torch.ones((t, ctx_len - key0), dtype=torch.bool), mask], dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    scores = attention_scores(scores, q_pos, k_pos, visible, sliding_window=sliding_window,
                              alibi_slopes=alibi_slopes, soft_cap=soft_cap)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [N, kvh, d] at flat slots ``slot_mapping`` [N] of the caches (an int8
    cache gets each row quantized with its own scale)."""
    num_kv_heads, row = k_cache.shape[2:]
    slots = slot_mapping.long()
    if kv_int8.is_int8(k_cache):
        key, value = kv_int8.pack(key), kv_int8.pack(value)
    k_cache.view(-1, num_kv_heads, row).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slots, value.to(v_cache.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' rounding: normalise in fp32, cast to x's dtype, then scale by weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is rounded to the dtype first."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                     rotary_dim: int, *, inplace: bool = True, interleaved: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) rotary embedding of q [T, nh*d] and k [T, kvh*d] at ``positions``;
    ``interleaved``: the GPT-J / GLM layout instead, where dims (2i, 2i + 1) form pair i
    (frequency i) rather than (i, i + rotary_dim / 2).

    ``cos_cache``/``sin_cache`` are [max_position, rotary_dim / 2]; dims >= rotary_dim pass
    through. Each of ``x1*cos``, ``x2*sin``, ... is rounded to the dtype, as torch does on
    tensors of that dtype. ``inplace``: write into q and k and return them; else return new
    contiguous tensors and leave q and k alone.
    """
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
    sin = sin_cache[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        x = x.view(T, -1, head_dim)
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            pairs = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            return torch.cat((pairs.flatten(-2), rest), dim=-1).reshape(T, -1)
        x1, x2 = rot.chunk(2, dim=-1)
        # Equals transformers' x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), bit for bit.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).view(T, -1)

    q_rot, k_rot = rotate(q), rotate(k)
    if not inplace:
        return q_rot, k_rot
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] (gate | up) -> silu(gate) * up [T, d]; silu rounds to the dtype, then the
    product does."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# Activations the kernels take, by their kernel names (the layers map transformers' names
# to these, model/layers/activation.py). Each twin is the expression transformers evaluates.
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gelu_new", "relu")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act`` applied elementwise in x's dtype: ``silu`` (F.silu), ``gelu`` (erf, F.gelu),
    ``gelu_tanh`` (F.gelu approximate="tanh", transformers' gelu_pytorch_tanh), ``gelu_new``
    (transformers' NewGELU formula, op by op), ``relu``."""
    if act == "silu":
        return F.silu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))
    if act == "relu":
        return F.relu(x)
    raise ValueError(f"activation {act!r} is not a kernel activation ({', '.join(ACTIVATIONS)})")


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """[T, 2d] (gate | up) -> act(gate) * up [T, d] (SwiGLU, GeGLU, ...): the activation
    rounds to the dtype, then the product does."""
    gate, up = x.chunk(2, dim=-1)
    return activation(gate, act) * up


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose weight is stored as an offset from 1 (Gemma's): normalise and scale by
    ``1 + weight`` all in fp32, one rounding to x's dtype at the end (transformers' order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def fused_add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor,
                                   weight: torch.Tensor, eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_unit_offset(x + residual), x + residual); the sum rounded to the dtype."""
    x = x + residual
    return rms_norm_unit_offset(x, weight, eps), x


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """nn.LayerNorm over the last dimension (F.layer_norm: statistics in fp32, one rounding)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual); the sum rounded to the dtype."""
    x = x + residual
    return layer_norm(x, weight, bias, eps), x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x @ weight.T + bias`` (F.linear): x [..., K], weight [N, K], bias [N] -> [..., N]."""
    return F.linear(x, weight, bias)


def lora_sgmv(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              order: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, rank: int,
              slice_offsets: tuple[int, ...]) -> None:
    """Multi-LoRA delta in place: ``out[t, o_j:o_{j+1}] += (x[t] @ a[s][:, j*rank:(j+1)*rank])
    @ b[s][j*rank:(j+1)*rank, o_j:o_{j+1}]`` for each output slice j (``slice_offsets`` = o_0..o_n)
    and every token t of segment g, i.e. ``t in order[seg_start[g]:seg_start[g+1]]``, whose
    adapter slot is ``s = seg_slot[g]``. ``a``: [slots, in, n*rank], ``b``: [slots, n*rank, out]
    (the LoRA dtype; the delta is computed in fp32 and added to ``out`` in its dtype). The
    plain definition (one segment at a time): the compiled kernel's oracle and fallback."""
    starts = seg_start.tolist()
    for g, s in enumerate(seg_slot.tolist()):
        tok = order[starts[g]:starts[g + 1]]
        h = x.index_select(0, tok).float() @ a[s].float()
        for j in range(len(slice_offsets) - 1):
            lo, hi, q = slice_offsets[j], slice_offsets[j + 1], j * rank
            d = h[:, q:q + rank] @ b[s, q:q + rank, lo:hi].float()
            out[tok, lo:hi] = (out[tok, lo:hi].float() + d).to(out.dtype)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output: ``logits[rows[i], t] = -inf`` for every token ``t`` that row ``i`` of
    the packed ``bitmask`` ([G, W] int32; bit ``t % 32`` of word ``t // 32`` set = allowed)
    bans, in place. Tokens at or past ``32 * W`` are banned; bits past the logits' width are
    ignored; allowed logits are left as they are (not even -0.0 changes).

    ``rows`` given on the host are checked here (an IndexError names the range); rows already
    on an accelerator are not: reading them back would be a host sync in every constrained
    step, so there the caller checks them on the host first (``guided.bitmask``)."""
    vocab = logits.shape[1]
    if len(rows) == 0:
        return
    if rows.device.type == "cpu" and len(rows) and (
            int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise IndexError(f"apply_token_bitmask: a row is outside [0, {logits.shape[0]})")
    # Built where the bitmask lives (32 int32s: cheaper to make per call than to cache per device).
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = F.pad(allowed, (0, vocab - allowed.shape[1]))  # pads with False: banned
    rows = rows.to(device=logits.device, dtype=torch.int64)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


def unpack_int4_groups(codes: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` codes, byte j of each group of ``group`` columns holding column j
    (low nibble) and column ``group / 2 + j`` (high nibble) -> their values ``[N, K]``."""
    n, half_k = codes.shape
    c = codes.view(n, half_k // (group // 2), group // 2)
    return torch.cat((c & 15, c >> 4), dim=-1).reshape(n, 2 * half_k)


def linear_int4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """``x @ ((q - z) * s).T + bias`` for 4-bit codes in the layout of ``unpack_int4_groups``,
    scales and zeros ``[N, K / group]`` (fp32)."""
    q = unpack_int4_groups(codes, group).to(torch.float32)
    w = (q - zeros.repeat_interleave(group, dim=1)) * scales.repeat_interleave(group, dim=1)
    return torch.nn.functional.linear(x, w.to(x.dtype), bias)


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing, as transformers' Mixtral / Qwen2-MoE / Qwen3-MoE routers:
    softmax over the experts in fp32, the ``top_k`` largest (ties to the lower index, as
    ``torch.topk``), divided by their sum where ``renormalize``. Returns (weights [T, top_k]
    fp32, expert ids [T, top_k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' part of a mixture-of-experts MLP: ``out[t] = sum_j topk_weights[t, j] *
    down_e(silu(gate_e(x[t])) * up_e(x[t]))`` over the ``top_k`` experts ``e = topk_ids[t, j]``.

    x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
    topk_weights [T, k] (any float dtype; cast to x's dtype, as transformers does before the
    weighted sum); topk_ids [T, k] integer, ids outside ``[0, E)`` contribute nothing (expert
    parallelism: another rank holds that expert). Tokens are grouped by expert and only the
    selected experts' weights are read; each expert's contributions are added to ``out`` (x's
    dtype) in ascending expert order, as transformers' loop does."""
    T, E = x.shape[0], w13.shape[0]
    out = torch.zeros(T, w2.shape[1], dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    ids = topk_ids.long()
    weights = topk_weights.to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(-1, E).add(1), minlength=E + 2)[1:E + 1].tolist()
    start = int((flat < 0).sum())
    k = ids.shape[1]
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        h = silu_and_mul(F.linear(x.index_select(0, tok), w13[e]))
        y = F.linear(h, w2[e]) * weights.reshape(-1)[pairs, None]
        out.index_add_(0, tok, y)
    return out
