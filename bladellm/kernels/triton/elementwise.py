"""GPU elementwise kernels in Triton: KV-cache store (float or int8 rows), RMSNorm, (1 + w)
RMSNorm and LayerNorm (each + residual add), rotary embedding (neox or interleaved), SiLU-and-mul
and the other activations (plain and gated). Their twins are the reference kernels in
``bladellm/kernels/ref.py`` (the same contracts: argument order, shapes, in-place behaviour,
output dtypes).

Rounding follows the twins, which follow transformers: math in fp32, and a rounding to the
activation dtype wherever torch would round (``_round`` below), so a 16-bit result matches the
twin bit for bit where fp32 arithmetic is exact or correctly rounded (products of 16-bit values,
``div_rn``/``sqrt_rn``). Where it is not (``exp`` in SiLU; fp32 sums reduced in another order;
fp32 multiply-adds the GPU compiler may contract into FMAs) results agree to an ulp.

Tests: tests/kernels/test_triton_elementwise.py, under ``TRITON_INTERPRET=1`` without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bladellm.kernels import kv_int8

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype not in _TL_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
    return _TL_DTYPES[dtype]


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """What torch does to an fp32 intermediate of a ``DTYPE`` tensor op: round it to DTYPE."""
    return x.to(DTYPE).to(tl.float32)


# ---- KV-cache store ------------------------------------------------------------------------------

@triton.jit
def _store_row(cache_ptr, row, dims, x, mask, head_ok, head_dim, KV_INT8: tl.constexpr):
    """Rows ``x [heads, d]`` at ``cache_ptr + row [heads]``; int8: kv_int8's format (absmax per row,
    round half to even, the fp32 scale after the values), the twin's fp32 operations."""
    if KV_INT8:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        safe = tl.where(amax > 0, amax, 1.0)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), safe),
                       0.0)
        y = x * inv[:, None]
        q = tl.floor(y + 0.5)  # exact: |y| <= 127
        q = tl.where((q - y == 0.5) & (q - 2.0 * tl.floor(q * 0.5) != 0.0), q - 1.0, q)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(cache_ptr + row[:, None] + dims, q.to(tl.int8), mask=mask)
        scale_ptr = (cache_ptr + row + head_dim).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)),
                 mask=head_ok)
    else:
        tl.store(cache_ptr + row[:, None] + dims, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                     num_kv_heads, head_dim, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS)
    head_ok = heads < num_kv_heads
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = head_ok[:, None] & (dims < head_dim)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims, mask=mask,
                other=0.0)
    _store_row(k_cache_ptr, row, dims, k, mask, head_ok, head_dim, KV_INT8)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims, mask=mask,
                other=0.0)
    _store_row(v_cache_ptr, row, dims, v, mask, head_ok, head_dim, KV_INT8)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value ``[N, kvh, d]`` (rows may be strided views of a fused qkv output) at flat
    slots ``slot_mapping [N]`` of caches ``[num_blocks, block_size, kvh, d]`` (or int8
    ``[..., d + 4]``: each row quantized with its own scale, ``kernels/kv_int8.py``); slot ``s``
    is block ``s // block_size``, offset ``s % block_size`` (attention/backend.py). Every slot
    must be valid (the twin's ``index_copy_`` contract): padding rows are sliced off by the
    caller."""
    if key.dim() != 3 or key.shape != value.shape or k_cache.shape != v_cache.shape \
            or k_cache.dtype != v_cache.dtype:
        raise ValueError("key/value must be [N, kvh, d] and the caches of one shape and dtype")
    int8 = kv_int8.is_int8(k_cache)
    if int8:
        kv_int8.check_head_dim(key.shape[2])
    row = kv_int8.row_width(key.shape[2]) if int8 else key.shape[2]
    if (key.shape[1], row) != k_cache.shape[2:] or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"key {tuple(key.shape)} / slot_mapping {tuple(slot_mapping.shape)} "
                         f"do not fit caches {tuple(k_cache.shape)}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride() != v_cache.stride() \
            or k_cache.stride(3) != 1:
        raise ValueError("the head dimension of key, value and the caches must be contiguous")
    n, num_kv_heads, head_dim = key.shape
    if n == 0:
        return
    # No mul+add -> FMA contraction: the int8 rounding must see x * inv rounded, as the twin
    # does (a fused y + 0.5 moves ties).
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1], num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=triton.next_power_of_2(head_dim),
        KV_INT8=int8, enable_fp_fusion=False)


# ---- RMSNorm -------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     X_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, X_DTYPE)  # the sum is a tensor of x's dtype in the twin
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(X_DTYPE), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    # div_rn(1, sqrt_rn): torch's rsqrt is correctly rounded; tl.rsqrt is approximate on GPUs.
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # (1 + w) RMSNorm: all in fp32, one rounding (ref.rms_norm_unit_offset)
        tl.store(out_ptr + row * stride_o + cols, ((x * inv) * (1.0 + w)).to(X_DTYPE),
                 mask=mask)
    else:
        h = _round(x * inv, X_DTYPE)
        tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return x.reshape(-1, x.shape[-1])


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, unit_offset: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    x_dtype = _tl_dtype(x.dtype)
    # ``weight * h.to(x.dtype)`` in the twin: the result dtype is the promoted one.
    # (1 + w) RMSNorm rounds once to x's dtype.
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) \
        if residual is not None else None
    x2, o2 = _rows(x), out.view(-1, x.shape[-1])
    r2 = _rows(residual) if residual is not None else x2
    nr2 = new_res.view(-1, x.shape[-1]) if new_res is not None else o2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, nr2, x.shape[-1], eps, x2.stride(0), r2.stride(0), o2.stride(0),
            nr2.stride(0), X_DTYPE=x_dtype, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[-1]), UNIT_OFFSET=unit_offset)
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ref.rms_norm``: normalise in fp32, round to x's dtype, scale by ``weight``."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.fused_add_rms_norm``: (rms_norm(x + residual), x + residual) in one pass; both are
    new tensors, x and residual are left alone."""
    out, new_res = _launch_rms_norm(x, residual, weight, eps)
    return out, new_res


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ref.rms_norm_unit_offset``: scale by ``1 + weight`` in fp32, one rounding."""
    return _launch_rms_norm(x, None, weight, eps, unit_offset=True)[0]


def fused_add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor,
                                   weight: torch.Tensor, eps: float
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.fused_add_rms_norm_unit_offset`` in one pass."""
    out, new_res = _launch_rms_norm(x, residual, weight, eps, unit_offset=True)
    return out, new_res


# ---- LayerNorm -----------------------------------------------------------------------------------

@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, n_cols, eps,
                       stride_x, stride_r, stride_o, stride_ro,
                       X_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, X_DTYPE)
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(X_DTYPE), mask=mask)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / n_cols
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = centred * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(X_DTYPE), mask=mask)


def _launch_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       bias: torch.Tensor | None, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"weight and bias must be [{n}], got {tuple(weight.shape)}"
                         f"{'' if bias is None else f' and {tuple(bias.shape)}'}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) \
        if residual is not None else None
    x2, o2 = _rows(x), out.view(-1, n)
    r2 = _rows(residual) if residual is not None else x2
    nr2 = new_res.view(-1, n) if new_res is not None else o2
    if x2.shape[0]:
        _layer_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, weight if bias is None else bias, o2, nr2, n, eps, x2.stride(0),
            r2.stride(0), o2.stride(0), nr2.stride(0), X_DTYPE=_tl_dtype(x.dtype),
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
            BLOCK=triton.next_power_of_2(n))
    return out, new_res


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``ref.layer_norm`` (two-pass statistics in fp32: equal to F.layer_norm to rounding)."""
    return _launch_layer_norm(x, None, weight, bias, eps)[0]


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.fused_add_layer_norm`` in one pass."""
    out, new_res = _launch_layer_norm(x, residual, weight, bias, eps)
    return out, new_res


# ---- Rotary embedding (neox / rotate-half, or interleaved pairs) ---------------------------------

@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, num_heads, head_dim, half,
                   stride_xt, stride_cos,
                   DTYPE: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr,
                   INTERLEAVED: tl.constexpr = False):
    """In place on ``x [T, heads * head_dim]``: the first ``2 * half`` dims of each head are
    rotated, the rest are not touched."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=j < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + j, mask=j < half, other=0.0).to(tl.float32)
    heads = tl.arange(0, HEADS)[:, None]
    mask = (heads < num_heads) & (j[None, :] < half)
    if INTERLEAVED:  # pair j is dims (2j, 2j + 1)
        p1 = x_ptr + t * stride_xt + heads * head_dim + 2 * j[None, :]
        p2 = p1 + 1
    else:  # pair j is dims (j, j + half)
        p1 = x_ptr + t * stride_xt + heads * head_dim + j[None, :]
        p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # The twin's tensor ops, each rounded to the dtype: x1*cos - x2*sin, x2*cos + x1*sin.
    o1 = _round(x1 * cos, DTYPE) - _round(x2 * sin, DTYPE)
    o2 = _round(x2 * cos, DTYPE) + _round(x1 * sin, DTYPE)
    tl.store(p1, o1.to(DTYPE), mask=mask)
    tl.store(p2, o2.to(DTYPE), mask=mask)


def _rotate_in_place(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
                     interleaved: bool) -> None:
    if x.dim() != 2 or x.shape[1] % head_dim or x.stride(1) != 1:
        raise ValueError(f"q/k must be [T, heads * {head_dim}] with contiguous rows")
    if x.shape[0] == 0:
        return
    num_heads, half = x.shape[1] // head_dim, rotary_dim // 2
    # No FMA contraction: the twin rounds each product before the sum (torch's tensor ops).
    _rotary_kernel[(x.shape[0],)](
        x, positions, cos_cache, sin_cache, num_heads, head_dim, half, x.stride(0),
        cos_cache.stride(0), DTYPE=_tl_dtype(x.dtype), HEADS=triton.next_power_of_2(num_heads),
        HALF=triton.next_power_of_2(half), INTERLEAVED=interleaved, enable_fp_fusion=False)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int,
                     rotary_dim: int, *, inplace: bool = True, interleaved: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref.rotary_embedding`` (neox, or ``interleaved`` GPT-J / GLM pairs):
    q ``[T, nh*d]`` and k ``[T, kvh*d]`` (rows may be strided views of the qkv output) rotated
    at ``positions [T]`` with cos/sin ``[max_position, rotary_dim / 2]`` in q's dtype. In place
    (returns q, k), or on contiguous copies (``inplace=False``)."""
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got "
                         f"{rotary_dim}")
    if cos_cache.shape != sin_cache.shape or cos_cache.shape[1:] != (rotary_dim // 2,) \
            or cos_cache.stride(1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError(f"cos/sin caches must be [max_position, {rotary_dim // 2}] with "
                         f"contiguous rows")
    if not (q.dtype == k.dtype == cos_cache.dtype == sin_cache.dtype):
        raise ValueError(f"q, k and the cos/sin caches must share a dtype, got {q.dtype}, "
                         f"{k.dtype}, {cos_cache.dtype}, {sin_cache.dtype}")
    if positions.shape != (q.shape[0],) or k.shape[0] != q.shape[0]:
        raise ValueError("positions must be [T] for q and k of T rows")
    if not inplace:
        q, k = q.contiguous().clone(), k.contiguous().clone()
    _rotate_in_place(q, positions, cos_cache, sin_cache, head_dim, rotary_dim, interleaved)
    _rotate_in_place(k, positions, cos_cache, sin_cache, head_dim, rotary_dim, interleaved)
    return q, k


# ---- SiLU and mul --------------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o,
                         DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE)  # F.silu rounds first
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(DTYPE), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``ref.silu_and_mul``: ``[..., 2d]`` (gate | up) -> ``silu(gate) * up`` ``[..., d]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even (gate | up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2, o2 = _rows(x), out.view(-1, d)
    block = min(block, triton.next_power_of_2(max(d, 1)))
    if x2.shape[0] and d:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, o2, d, x2.stride(0), o2.stride(0), DTYPE=_tl_dtype(x.dtype), BLOCK=block)
    return out


# ---- Activations (plain and gated) ---------------------------------------------------------------

# ref.ACTIVATIONS by code (the constexpr ACT below).
_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "gelu_new": 3, "relu": 4}


@triton.jit
def _tanh(y):
    e = tl.exp(tl.minimum(2.0 * tl.abs(y), 80.0))  # tanh is 1 in fp32 long before
    t = 1.0 - tl.math.div_rn(2.0, e + 1.0)
    return tl.where(y < 0, -t, t)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """``ref.activation`` in fp32 (x fp32)."""
    if ACT == 0:
        y = tl.math.div_rn(x, 1.0 + tl.exp(-x))
    elif ACT == 1:
        y = x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 4:
        y = tl.where(x > 0, x, tl.where(x != x, x, 0.0))
    else:  # the tanh GELUs: one formula, computed in fp32
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))
    return y


@triton.jit
def _act_kernel(x_ptr, out_ptr, d, stride_x, stride_o, DTYPE: tl.constexpr, ACT: tl.constexpr,
                GATED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _act(x, ACT)
    if GATED:
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        y = _round(y, DTYPE) * up  # the activation is a tensor of the dtype in the twin
    tl.store(out_ptr + row * stride_o + cols, y.to(DTYPE), mask=mask)


def _launch_act(x: torch.Tensor, act: str, gated: bool, block: int) -> torch.Tensor:
    if act not in _ACT_CODES:
        raise ValueError(f"activation {act!r} is not one of {', '.join(_ACT_CODES)}")
    if gated and x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even (gate | up), got {x.shape[-1]}")
    d = x.shape[-1] // 2 if gated else x.shape[-1]
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2, o2 = _rows(x), out.view(-1, d)
    block = min(block, triton.next_power_of_2(max(d, 1)))
    if x2.shape[0] and d:
        _act_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, o2, d, x2.stride(0), o2.stride(0), DTYPE=_tl_dtype(x.dtype),
            ACT=_ACT_CODES[act], GATED=gated, BLOCK=block)
    return out


def act_and_mul(x: torch.Tensor, act: str, block: int = 1024) -> torch.Tensor:
    """``ref.act_and_mul``: ``[..., 2d]`` (gate | up) -> ``act(gate) * up`` ``[..., d]``."""
    return _launch_act(x, act, True, block)


def activation(x: torch.Tensor, act: str, block: int = 1024) -> torch.Tensor:
    """``ref.activation``: ``act`` elementwise, in fp32, rounded once."""
    return _launch_act(x, act, False, block)
