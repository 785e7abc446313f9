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

import torch
import triton
import triton.language as tl


# ---- W4A16 / W8A16: group-dequantized weight-only GEMM ------------------------------------------

@triton.jit
def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, group_size,
                  stride_xm, stride_xk, stride_qk, stride_qn, stride_sg, stride_sn,
                  stride_zg, stride_zn, stride_om, stride_on,
                  BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    per_word: tl.constexpr = 32 // BITS
    mask_value: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & mask_k[None, :], other=0.0)
        # Each of the per_word rows sharing a word loads it and shifts out its own bits.
        mask_kn = mask_k[:, None] & (offs_n[None, :] < N)
        words = tl.load(qw_ptr + (offs_k // per_word)[:, None] * stride_qk
                        + offs_n[None, :] * stride_qn, mask=mask_kn, other=0)
        shift = ((offs_k % per_word) * BITS)[:, None]
        q = ((words >> shift) & mask_value).to(tl.float32)
        group = offs_k // group_size
        scale = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                        mask=mask_kn, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                           mask=mask_kn, other=0).to(tl.float32)
        else:
            zero = float(1 << (BITS - 1))
        w = (q - zero) * scale
        acc += tl.dot(x.to(tl.float32), w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


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
    return m, n, k


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, bits: int, group_size: int,
               bias: torch.Tensor | None = None, block_m: int = 16, block_n: int = 64,
               block_k: int = 64) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight).T``-equivalent: ``[M, N]`` in ``x``'s dtype (layout above;
    per-channel quantization is ``group_size = K``)."""
    m, n, k = _check_wna16(x, qweight, scales, zeros, bits, group_size)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(block_k, triton.next_power_of_2(k))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    z = zeros if zeros is not None else scales  # unused pointer when HAS_ZEROS is false
    _wna16_kernel[grid](
        x, qweight, scales, z, bias if bias is not None else scales, out, m, n, k, group_size,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), z.stride(0), z.stride(1), out.stride(0),
        out.stride(1), BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
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
def _w8a8_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, b_ptr, out_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wk, stride_wn, stride_om, stride_on,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(xq_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0)
        b = tl.load(wq_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             y.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None, block_m: int = 16,
              block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``(xq [M, K] int8 @ wq [K, N] int8)`` in int32, scaled per token and per channel."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8 or xq.shape[1] != wq.shape[0]:
        raise ValueError("xq must be int8 [M, K] and wq int8 [K, N]")
    m, k = xq.shape
    n = wq.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](xq, x_scale, wq, w_scale, bias if bias is not None else w_scale, out,
                       m, n, k, xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1),
                       out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
                       BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))))
    return out


def w8a8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                  w_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin: exact int32 accumulation (int64 on the CPU, no overflow at these sizes), then the
    same float32 scaling."""
    acc = (xq.to(torch.int64) @ wq.to(torch.int64)).to(torch.float32)
    y = acc * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
