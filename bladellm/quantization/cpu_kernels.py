"""CPU matmuls on quantized weights, each with its own load-time layout of an ``IntWeight``.

* ``DequantLinear`` (weight-only, any bits/groups/zeros/act-order): the weight stays 4-bit
  (two values per byte) or 8-bit in memory; each call dequantizes it to the activation dtype and
  runs one BLAS GEMM. Its math is the twin's (``dequantize``): results equal F.linear on the
  dequantized weight up to GEMM rounding.
* ``AtenInt4Linear`` (4-bit, groups of 32..256 in order, N % 16 == 0): ATen's
  ``_weight_int4pack_mm_for_cpu``, which decodes the weight inside the kernel. On AVX2 it runs
  one pass over the weight per row of x and lost to ``DequantLinear`` even at M = 1: measured
  (benchmarks/quantized_linear.py), not chosen (``ATEN_INT4_MAX_ROWS``).
* ``Int8DynamicLinear`` (W8A8): x quantized per token to int8 at call time, an int8 GEMM
  (fbgemm, ``quantized::linear_dynamic``, exact integer sums), the per-channel weight scales
  and per-token x scales applied to the result. ``w8a8_reference`` is its twin.

Which is used is decided per layer at load time by ``choose_weight_only_kernel`` /
``choose_w8a8_kernel`` from the measurements in docs/quantization.md
(benchmarks/quantized_linear.py); the 4-bit decode path runs on the kernel set the layer was
built with (``--kernels``), handed in.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from bladellm.kernels.interface import Kernels
from bladellm.quantization.int_weight import IntWeight

logger = logging.getLogger(__name__)

# Rows of x up to which ATen's int4 kernel is used. 0: on AVX2 it lost to dequantize + GEMM
# at every M measured, M = 1 included (docs/quantization.md), so the engine never builds its
# layout; the class stays for the benchmark and for CPUs where it wins.
ATEN_INT4_MAX_ROWS = 0


def _sorted_columns(w: IntWeight) -> tuple[IntWeight, torch.Tensor | None, int]:
    """The weight with its input columns in group order, the permutation that x must then
    take (None if already in order) and the group size."""
    in_order, size = w.is_grouped_in_order()
    if in_order:
        return w, None, size
    k, g = w.q.shape[1], w.num_groups
    perm = torch.argsort(w.g_idx, stable=True)
    counts = torch.bincount(w.g_idx, minlength=g)
    if k % g or not bool((counts == k // g).all()):
        raise ValueError("g_idx: act-order groups of unequal size are not supported")
    return IntWeight(w.q[:, perm], w.scales, w.zeros, w.g_idx[perm], w.bits), perm, k // g


class DequantLinear:
    """Weight-only: ``bits``-bit codes kept packed; dequantized per call, then one GEMM (at
    decode sizes, ``kernels.linear_int4`` on the codes where that set has one)."""

    name = "dequant+gemm"

    def __init__(self, w: IntWeight, kernels: Kernels) -> None:
        w, self.perm, self.group_size = _sorted_columns(w)
        n, k = w.q.shape
        zeros = w.zeros if w.zeros is not None else torch.zeros_like(w.scales, dtype=torch.int16)
        q = w.q.to(torch.int16)
        groups = k // self.group_size
        if w.bits == 4:  # unsigned nibbles, two per byte: column j and j + size/2 of a group
            shift = 8 if int(q.min()) < 0 else 0
            q, zeros = q + shift, zeros + shift
            if self.group_size % 2:
                raise ValueError(f"4-bit weight with odd groups of {self.group_size} columns")
            half = self.group_size // 2
            q = q.to(torch.uint8).view(n, groups, self.group_size)
            self.codes = (q[..., :half] | (q[..., half:] << 4)).contiguous()
        else:  # int8 storage
            shift = -128 if int(q.max()) > 127 else 0
            q, zeros = q + shift, zeros + shift
            self.codes = q.to(torch.int8).view(n, groups, self.group_size).contiguous()
        self.bits, self.shape = w.bits, (n, k)
        self.scales = w.scales.reshape(n, groups, 1).contiguous()
        self.zeros = zeros.to(torch.float32).reshape(n, groups, 1).contiguous()
        # Made once, not per call: the 2-D views of the codes, scales and zeros that the
        # kernel set's 4-bit kernel takes.
        self.kernels = kernels
        self.int4_args = ((self.codes.view(n, k // 2), self.scales.view(n, groups),
                           self.zeros.view(n, groups)) if w.bits == 4 else ())

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in sorted-column order (the twin's values). Split halves and
        in-place arithmetic, not interleaved nibbles through torch.stack (far slower;
        docs/kernels.md)."""
        n, k = self.shape
        if self.bits == 4:
            half = self.group_size // 2
            q = torch.empty(n, k // self.group_size, self.group_size)
            q[..., :half].copy_(self.codes & 15)
            q[..., half:].copy_(self.codes >> 4)
        else:
            q = self.codes.to(torch.float32)
        return q.sub_(self.zeros).mul_(self.scales).view(n, k).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if (self.bits == 4 and x.dtype == torch.float32
                and x.numel() // max(x.shape[-1], 1) <= self.kernels.int4_max_rows):
            # Decode sizes: the compiled kernel reads the 4-bit codes directly; larger M is
            # dequantize + one GEMM (below).
            return self.kernels.linear_int4(x, *self.int4_args, bias, self.group_size)
        return F.linear(x, self.weight(x.dtype), bias)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


class AtenInt4Linear:
    """4-bit weight-only through ``torch._weight_int4pack_mm_for_cpu`` for at most
    ``ATEN_INT4_MAX_ROWS`` rows, ``DequantLinear`` (sharing nothing but the scales) above."""

    name = "aten-int4pack"

    @staticmethod
    def unsupported(w: IntWeight) -> str | None:
        in_order, size = w.is_grouped_in_order()
        n, k = w.q.shape
        if w.bits != 4:
            return "not 4-bit"
        if not in_order or size not in (32, 64, 128, 256):
            return "groups not of 32/64/128/256 columns in order"
        if n % 16:
            return "output features not a multiple of 16"
        return None

    def __init__(self, w: IntWeight, fallback: DequantLinear) -> None:
        q = w.q.to(torch.int32)
        zeros = w.zeros if w.zeros is not None else torch.zeros_like(w.scales, dtype=torch.int16)
        if int(q.min()) < 0:
            q, zeros = q + 8, zeros + 8
        _, self.group_size = w.is_grouped_in_order()
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # ATen decodes (q - 8) * scale + zero: zero = (8 - z) * scale gives (q - z) * scale.
        zero = (8 - zeros.to(torch.float32)) * w.scales
        self.scales_and_zeros = torch.stack((w.scales.t(), zero.t()), dim=-1).contiguous()
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > ATEN_INT4_MAX_ROWS or x.dtype != torch.float32:
            return self.fallback(x, bias)
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(rows, -1), self.packed,
                                              self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (integer values as float32 in [-127, 127], scales [rows, 1])."""
    x = x.to(torch.float32)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x / scale).clamp_(-127, 127), scale


def w8a8_reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``Int8DynamicLinear``: per-token int8 x, exact integer dot products
    (float64 holds every int8 x int8 sum exactly), per-channel weight scale."""
    xq, xs = quantize_per_token(x.reshape(-1, x.shape[-1]))
    acc = xq.to(torch.float64) @ w.q.to(torch.float64).t()
    y = (acc * xs.to(torch.float64) * w.scales[:, 0].to(torch.float64)).to(x.dtype)
    y = y.reshape(*x.shape[:-1], -1)
    return y + bias if bias is not None else y


class Int8DynamicLinear:
    """W8A8 through fbgemm's int8 GEMM with per-token activation scales, exact.

    fbgemm quantizes its input per tensor (uint8; scale and zero point from the min and max).
    x is quantized per token here to integers in [-127, 127], and a pad row fixes that min and
    max so that fbgemm's scale is exactly 1 and its codes are our integers (shifted by its zero
    point); the pad row's output is dropped, the result scaled per token and per channel.
    Bit-exact integer sums, like the twin (``w8a8_reference``).

    ``split`` (the default without AVX-512 VNNI): fbgemm's AVX2 / plain AVX-512 kernels add
    pairs of u8 x s8 products in 16 bits with saturation, so codes above 127 can overflow. x is
    split into its positive and negative parts, each in [0, 127] (a pair of products then stays
    below 2**15), stacked as rows [x+; x-; 0 ... 255] (zero point 0), and
    ``y = (x+ @ W) - (x- @ W)``: one GEMM over 2M + 1 rows.
    Without ``split`` (AVX-512 VNNI: ``vpdpbusd`` accumulates u8 x s8 products in 32 bits, no
    saturation): rows [x; -128 127 0 ...], zero point 128, one GEMM over M + 1 rows, half the
    work."""

    name = "fbgemm-int8"

    def __init__(self, w: IntWeight, split: bool = True) -> None:
        if w.num_groups != 1 or w.zeros is not None:
            raise ValueError("W8A8 needs symmetric per-channel weights")
        n, k = w.q.shape
        if not split and k < 2:
            raise ValueError("W8A8 without split needs at least 2 input features")
        qw = torch._make_per_channel_quantized_tensor(
            w.q.to(torch.int8), w.scales[:, 0].to(torch.float64),
            torch.zeros(n, dtype=torch.int64), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        # fbgemm's packed weight is an opaque object, not a tensor: what it holds (the int8
        # codes, per-channel scale and zero point, column offsets) is counted here for the memory
        # accounting (``model_weight_bytes``), which sees only tensors otherwise.
        self.opaque_bytes = n * k + n * (8 + 8 + 4)
        self.split = split
        self.pad = torch.zeros(1, k)
        if split:
            self.pad[0, -1] = 255.0
        else:
            self.pad[0, 0], self.pad[0, 1] = -128.0, 127.0
            self.name = "fbgemm-int8-vnni"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        xq, xs = quantize_per_token(rows)
        if self.split:
            stacked = torch.cat((xq.clamp(min=0), (-xq).clamp_(min=0), self.pad))
            y = torch.ops.quantized.linear_dynamic(stacked, self.packed, False)
            y = y[:m] - y[m:2 * m]
        else:
            y = torch.ops.quantized.linear_dynamic(torch.cat((xq, self.pad)), self.packed,
                                                   False)[:m]
        y = (y * xs).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y + bias if bias is not None else y


class Int8ReferenceLinear:
    """W8A8 through the twin (no fbgemm in this torch build)."""

    name = "reference-int8"

    def __init__(self, w: IntWeight) -> None:
        self.w = w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_reference(x, self.w, bias)


@functools.lru_cache(maxsize=1)
def has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def int8_gemm_accumulates_in_32_bits(flags: frozenset[str] | None = None) -> bool:
    """Whether fbgemm's int8 GEMM runs on AVX-512 VNNI here (``vpdpbusd``: no 16-bit
    saturation, so ``Int8DynamicLinear`` needs no split)."""
    if flags is None:
        from bladellm.platforms.cpu import detect_cpu

        flags = detect_cpu().flags
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags


def choose_w8a8_kernel(w: IntWeight, flags: frozenset[str] | None = None):
    if not has_fbgemm():
        return Int8ReferenceLinear(w)
    return Int8DynamicLinear(w, split=not int8_gemm_accumulates_in_32_bits(flags))


def choose_weight_only_kernel(w: IntWeight, kernels: Kernels):
    dequant = DequantLinear(w, kernels)
    if ATEN_INT4_MAX_ROWS > 0 and AtenInt4Linear.unsupported(w) is None:
        return AtenInt4Linear(w, dequant)
    return dequant
