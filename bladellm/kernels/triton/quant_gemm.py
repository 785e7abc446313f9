"""GPU quantized GEMMs in Triton, each with its plain-PyTorch twin (``*_ref``).

Layouts (what a quantized linear method keeps on the GPU after unpacking a checkpoint once):

* **W4A16 / W8A16** (GPTQ, AWQ, compressed-tensors pack-quantized): ``qweight`` int32
  ``[K / (32 / bits), N]``, the values of input rows ``k`` packed little-endian into word
  ``k // (32 / bits)`` at bits ``[bits * (k % (32/bits)), ...)`` (GPTQ's order along K);
  ``scales`` ``[G, N]`` in the activation dtype or float32; ``zeros`` int32 ``[G, N]`` unpacked
  (None: symmetric, the unsigned value's zero point is ``2^(bits-1)``); group ``g = k //
  group_size``. Act-order checkpoints are permuted at load time so that groups are contiguous:
  the method keeps the permutation and gathers the input's columns with it (``x[:, perm]``)
  before the GEMM. The group dequantization ``(q - z) * s`` is fused into the K loop: the weight
  never exists in 16-bit form in memory, which is the point (4x fewer bytes read per token).
* **W8A8** (SmoothQuant, compressed-tensors int-quantized): activations quantized per token
  (``per_token_quant_int8``: symmetric, scale ``max|x| / 127``), int8 weight ``[K, N]`` with a
  float32 scale per output channel; int8 x int8 dot products accumulate in int32 and are scaled
  once at the end: ``y = (xq @ wq) * sx[:, None] * sw[None, :] (+ bias)``.

Tests run these under ``TRITON_INTERPRET=1`` at small shapes (tests/kernels/test_triton_quant.py)
against the twins; ``benchmarks/triton_quant_gemm.py`` times them on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bladellm.kernels.triton import INTERPRETING


# ---- tiles -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmTiles:
    """One launch's tiling. ``split_k`` > 1 gives each program a slice of K and sums the slices'
    float32 (int32 for W8A8) partials afterwards in a fixed order: decode-sized M leaves too few
    output tiles to keep every multiprocessor streaming weights otherwise, and the fixed order
    keeps results independent of the run (no atomics)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=8)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_tiles(m: int, n: int, k: int, device: torch.device,
                 block_k: tuple[int, int] = (128, 64), k_align: int = 0,
                 min_block_k: int = 16) -> GemmTiles:
    """Tiles by M: decode-sized M streams weights (narrow M tile, deep K, split-K until about two
    programs per multiprocessor), large M is matrix-bound (128-wide tiles, 8 warps).
    ``block_k``: the K tile for M <= 16 and above (W4A16 loads its packed words as one int32 per
    element, so a deep K tile at 128-wide N would overflow shared memory). ``k_align``: a K tile
    must divide it (the group size, for the group-aligned dequantization)."""
    if m <= 16:
        bm, bn, warps, bk = 16, 128, 4, block_k[0]
    elif m <= 64:
        bm, bn, warps, bk = max(16, triton.next_power_of_2(m)), 128, 4, block_k[1]
    else:
        bm, bn, warps, bk = 128, 128, 8, block_k[1]
    bk = min(bk, max(min_block_k, triton.next_power_of_2(k)))
    while bk > min_block_k and k_align % bk:
        bk //= 2
    split = 1
    if device.type == "cuda" and m <= 64:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        target = 2 * _multiprocessors(device.index if device.index is not None
                                      else torch.cuda.current_device())
        split = max(1, min(16, triton.cdiv(k, bk) // 2, target // max(tiles, 1)))
    return GemmTiles(bm, bn, bk, split, warps, 3)


# From M on, W4A16/W8A16 on a GPU dequantizes the weight and runs the 16-bit GEMM
# (benchmarks/triton_quant_gemm.py measures both paths at each M).
WNA16_DEQUANT_MIN_M = 17


def _k_per_split(k: int, tiles: GemmTiles) -> int:
    return triton.cdiv(triton.cdiv(k, tiles.block_k), tiles.split_k) * tiles.block_k


@triton.jit
def _reduce_splits_kernel(part_ptr, rs_ptr, cs_ptr, b_ptr, out_ptr, N, SPLIT, stride_ps,
                          stride_pm, stride_om, ROW_SCALE: tl.constexpr, COL_SCALE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.load(part_ptr + row * stride_pm + offs, mask=mask, other=0)
    for s in range(1, SPLIT):  # in split order: the result does not depend on timing
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + offs, mask=mask, other=0)
    y = acc.to(tl.float32)
    if ROW_SCALE:
        y = y * tl.load(rs_ptr + row)
    if COL_SCALE:
        y = y * tl.load(cs_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _reduce_splits(part: torch.Tensor, dtype: torch.dtype, row_scale: torch.Tensor | None = None,
                   col_scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_s part[s]`` (int32 sums stay exact), then ``* row_scale[:, None] * col_scale`` and
    ``+ bias`` in float32, cast to ``dtype``: one launch for what would be four torch ops."""
    split, m, n = part.shape
    out = torch.empty(m, n, dtype=dtype, device=part.device)
    block_n = min(1024, triton.next_power_of_2(n))
    dummy = part
    _reduce_splits_kernel[(m, triton.cdiv(n, block_n))](
        part, row_scale if row_scale is not None else dummy,
        col_scale if col_scale is not None else dummy, bias if bias is not None else dummy, out,
        n, split, part.stride(0), part.stride(1), out.stride(0),
        ROW_SCALE=row_scale is not None, COL_SCALE=col_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n)
    return out


# ---- W4A16 / W8A16: group-dequantized weight-only GEMM ------------------------------------------

@triton.jit
def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, group_size,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                  stride_zg, stride_zn, stride_os, stride_om, stride_on,
                  BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GROUP_TILE: tl.constexpr, DOT_IEEE: tl.constexpr, MAGIC: tl.constexpr,
                  BASE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each packed word is loaded once: the K tile is ``BLOCK_K / per_word`` word rows, and value
    ``j`` of every word (input row ``kw * per_word + j``) takes part in its own dot with the
    matching strided columns of x. The dot's sum over K does not care about the order of K, so no
    unpacked [BLOCK_K, BLOCK_N] tile is ever formed (no reshape, no 8x reloads)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    per_word: tl.constexpr = 32 // BITS
    KW: tl.constexpr = BLOCK_K // per_word
    mask_value: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kw = tl.arange(0, KW)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_word = k0 + offs_kw * per_word  # the first input row of each word
        mask_w = (k_word < k_end)[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (k_word // per_word)[:, None] * stride_qk
                        + offs_n[None, :] * stride_qn, mask=mask_w, other=0)
        if GROUP_TILE:
            # The whole K tile lies in one group: one scale (and zero) row, and the tile's dot
            # runs on q - z, small integers exact in 16 bits, scaled once afterwards.
            group = k0 // group_size
            scale = tl.load(s_ptr + group * stride_sg + offs_n * stride_sn, mask=mask_n,
                            other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + group * stride_zg + offs_n * stride_zn, mask=mask_n,
                               other=0).to(tl.float32)[None, :]
            else:
                zero = float(1 << (BITS - 1))
        else:
            # Groups are whole words (group_size % per_word == 0, checked): one row per word.
            group = k_word // group_size
            scale = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                            mask=mask_w, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                               mask=mask_w, other=0).to(tl.float32)
            else:
                zero = float(1 << (BITS - 1))
        if MAGIC != 0:
            # 16-bit operands without int -> float conversions (a quarter-rate instruction on
            # the GPU, two per weight otherwise): OR-ing a 4-bit q into the mantissa of MAGIC's
            # float gives BASE + q exactly; BASE + z is exact too, so their difference is q - z.
            zero16 = (zero + BASE).to(x_ptr.dtype.element_ty)
            if not GROUP_TILE:
                scale16 = scale.to(x_ptr.dtype.element_ty)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(per_word):
            kx = k_word + j
            xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :] * stride_xk,
                         mask=mask_m[:, None] & (kx < k_end)[None, :], other=0.0)
            if MAGIC != 0:
                bits16 = (((words >> (j * BITS)) & mask_value) | MAGIC).to(tl.int16)
                w16 = bits16.to(x_ptr.dtype.element_ty, bitcast=True) - zero16
                if not GROUP_TILE:
                    w16 = w16 * scale16
                part += tl.dot(xj, w16)
            else:
                w = ((words >> (j * BITS)) & mask_value).to(tl.float32) - zero
                if not GROUP_TILE:
                    w = w * scale
                if DOT_IEEE:
                    part += tl.dot(xj.to(tl.float32), w, input_precision="ieee")
                else:
                    part += tl.dot(xj, w.to(xj.dtype))
        if GROUP_TILE:
            acc += part * scale[None, :]
        else:
            acc += part
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om
             + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=256)  # per layer shape and batch size: called on every forward
def wna16_tiles(m: int, n: int, k: int, bits: int, group_size: int,
                device: torch.device) -> GemmTiles:
    """The fused kernel's tiles: K tiles of at least 16 packed words (the dot's K)."""
    words_k = 16 * (32 // bits)
    return choose_tiles(m, n, k, device, block_k=(256, words_k), k_align=group_size,
                        min_block_k=words_k)


def _check_wna16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int) -> tuple[int, int, int]:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError("x must be [M, K] and qweight int32 [K / (32 / bits), N]")
    m, k = x.shape
    per_word = 32 // bits
    if qweight.shape[0] * per_word != k:
        raise ValueError(f"qweight has {qweight.shape[0]} packed rows, K = {k} needs "
                         f"{k // per_word}")
    n = qweight.shape[1]
    if k % group_size or scales.shape != (k // group_size, n):
        raise ValueError(f"scales must be [K / group_size, N] = [{k // group_size}, {n}], got "
                         f"{tuple(scales.shape)}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError("zeros must have the shape of scales")
    if group_size % per_word:
        raise ValueError(f"group_size {group_size} is not a multiple of {per_word} (values per "
                         f"packed word)")
    return m, n, k


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, bits: int, group_size: int,
               bias: torch.Tensor | None = None, tiles: GemmTiles | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight).T``-equivalent: ``[M, N]`` in ``x``'s dtype (layout above;
    per-channel quantization is ``group_size = K``). ``tiles``: None picks them
    (``choose_tiles``). fp16/bf16 activations go through the tensor cores with float32
    accumulation; float32 activations use full-precision (not tf32) dot products."""
    m, n, k = _check_wna16(x, qweight, scales, zeros, bits, group_size)
    if tiles is None:
        if x.device.type == "cuda" and x.dtype != torch.float32 and m >= WNA16_DEQUANT_MIN_M:
            # Matrix-bound: one pass writes the dense weight, then the 16-bit GEMM (cuBLAS).
            # The fused kernel's dequantization in every K step costs more than that pass.
            w = dequant_wna16(qweight, scales, zeros, bits, group_size, x.dtype)
            return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
        tiles = wna16_tiles(m, n, k, bits, group_size, x.device)
    if tiles.block_k % (16 * (32 // bits)):
        raise ValueError(f"block_k {tiles.block_k} must be a multiple of 16 packed words "
                         f"({16 * (32 // bits)} rows at {bits} bits): the dot's K")
    split = tiles.split_k
    # A split's partials stay float32 until they are summed; one split writes x's dtype.
    out = torch.empty((split, m, n) if split > 1 else (1, m, n),
                      dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    z = zeros if zeros is not None else scales  # unused pointer when HAS_ZEROS is false
    has_bias = bias is not None and split == 1
    dot_ieee = x.dtype == torch.float32 or (INTERPRETING and x.dtype == torch.bfloat16)
    # bf16 0x4300 = 128 and fp16 0x6400 = 1024 have a mantissa ulp of 1: BASE + q is exact.
    magic, base = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}.get(
        x.dtype, (0, 0.0)) if bits == 4 and not dot_ieee else (0, 0.0)
    _wna16_kernel[grid](
        x, qweight, scales, z, bias if has_bias else scales, out, m, n, k,
        _k_per_split(k, tiles), group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), z.stride(0), z.stride(1), out.stride(0),
        out.stride(1), out.stride(2), BITS=bits, HAS_ZEROS=zeros is not None,
        HAS_BIAS=has_bias, GROUP_TILE=group_size % tiles.block_k == 0,
        DOT_IEEE=dot_ieee, MAGIC=magic, BASE=base, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if split == 1:
        return out[0]
    return _reduce_splits(out, x.dtype, bias=bias)


@triton.jit
def _dequant_wna16_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size,
                          stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
                          stride_ok, stride_on, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    per_word: tl.constexpr = 32 // BITS
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    words = tl.load(qw_ptr + (offs_k // per_word)[:, None] * stride_qk
                    + offs_n[None, :] * stride_qn, mask=mask, other=0)
    q = ((words >> ((offs_k % per_word) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    group = offs_k // group_size
    scale = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask,
                    other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                       mask=mask, other=0).to(tl.float32)
    else:
        zero = float(1 << (BITS - 1))
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :] * stride_on,
             ((q - zero) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequant_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[K, N]`` weight in ``dtype`` (each value rounded once from float32)."""
    per_word = 32 // bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    z = zeros if zeros is not None else scales
    block_k, block_n = 32, 128
    _dequant_wna16_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        qweight, scales, z, out, n, k, group_size, qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), z.stride(0), z.stride(1), out.stride(0),
        out.stride(1), BITS=bits, HAS_ZEROS=zeros is not None, BLOCK_K=block_k,
        BLOCK_N=block_n)
    return out


def unpack_wna16_ref(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The twin's unpacking: int32 ``[K / (32 / bits), N]`` -> unsigned values ``[K, N]``."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, qweight.shape[1])


def wna16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, bits: int, group_size: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch twin of ``wna16_gemm``: dequantize to float32, matmul, cast."""
    _check_wna16(x, qweight, scales, zeros, bits, group_size)
    q = unpack_wna16_ref(qweight, bits).float()
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = (zeros.float().repeat_interleave(group_size, dim=0) if zeros is not None
         else float(1 << (bits - 1)))
    y = x.float() @ ((q - z) * s)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_wna16(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``[K, N]`` values -> the int32 ``[K / (32 / bits), N]`` layout above (load-time
    repacking and tests)."""
    per_word = 32 // bits
    k, n = values.shape
    if k % per_word:
        raise ValueError(f"K = {k} is not a multiple of {per_word}")
    v = values.to(torch.int64).reshape(k // per_word, per_word, n)
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * bits
    packed = (v << shifts[None, :, None]).sum(dim=1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


# ---- W8A8: per-token int8 activations x per-channel int8 weights ---------------------------------

@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                            BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-10) / 127.0
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        y = x.to(tl.float32) / scale
        # Round half away from zero, like the twin.
        q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(tl.int8), mask=k0 + offs < K)


def per_token_quant_int8(x: torch.Tensor, block_k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token quantization: (int8 ``[M, K]``, float32 scales ``[M]``)."""
    if x.dim() != 2:
        raise ValueError("x must be [M, K]")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    _per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0),
                                  BLOCK_K=min(block_k, triton.next_power_of_2(k)))
    return q, s


def per_token_quant_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    s = xf.abs().amax(dim=1).clamp_min(1e-10) / 127.0
    y = xf / s[:, None]
    q = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(-y + 0.5)).clamp(-127, 127)
    return q.to(torch.int8), s


@triton.jit
def _w8a8_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT,
                 stride_xm, stride_xk, stride_wk, stride_wn, stride_os, stride_om, stride_on,
                 HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end), other=0)
        b = tl.load(wq_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(offs_k[:, None] < k_end) & (offs_n[None, :] < N), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    mask_out = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_offs = pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if SCALE:
        xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
        ws = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:  # a split's exact int32 partial; scaled once the splits are summed
        tl.store(out_ptr + out_offs, acc, mask=mask_out)


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              tiles: GemmTiles | None = None) -> torch.Tensor:
    """``(xq [M, K] int8 @ wq [K, N] int8)`` in int32, scaled per token and per channel. Keep the
    weight K-contiguous (``wq = w_nk.t()`` for an ``[N, K]`` tensor): Hopper's int8 tensor-core
    instructions take both operands K-major.
    ``tiles``: None picks them (``choose_tiles``); split-K partials are int32, so their sum is
    exact and the result does not depend on the split."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8 or xq.shape[1] != wq.shape[0]:
        raise ValueError("xq must be int8 [M, K] and wq int8 [K, N]")
    m, k = xq.shape
    n = wq.shape[1]
    if tiles is None:
        tiles = choose_tiles(m, n, k, xq.device, block_k=(128, 128), min_block_k=32)
    split = tiles.split_k
    out = torch.empty((split, m, n), dtype=out_dtype if split == 1 else torch.int32,
                      device=xq.device)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    has_bias = bias is not None and split == 1
    _w8a8_kernel[grid](xq, x_scale, wq, w_scale, bias if has_bias else w_scale, out,
                       m, n, k, _k_per_split(k, tiles), xq.stride(0), xq.stride(1),
                       wq.stride(0), wq.stride(1), out.stride(0), out.stride(1), out.stride(2),
                       HAS_BIAS=has_bias, SCALE=split == 1, BLOCK_M=tiles.block_m,
                       BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                       num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if split == 1:
        return out[0]
    return _reduce_splits(out, out_dtype, row_scale=x_scale, col_scale=w_scale, bias=bias)


def w8a8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                  w_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: the exact integer sum (in float64, exact while K * 127^2 < 2^53, and a dtype whose
    matmul exists on every device, unlike int64 on CUDA), then the same float32 scaling."""
    acc = (xq.to(torch.float64) @ wq.to(torch.float64)).to(torch.float32)
    y = acc * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
