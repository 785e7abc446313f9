"""GPU matmuls on quantized weights: an ``IntWeight`` repacked once into the layout of the
Triton kernels (``bladellm/kernels/triton/quant_gemm.py``), which fuse the group dequantization
into the GEMM (W4A16 / W8A16) or run int8 x int8 dot products (W8A8).

Chosen by ``QuantLinearMethod`` for weights on a CUDA device (the CPU kernels are in
``cpu_kernels.py``). The layouts: codes unsigned (a symmetric weight's signed codes shifted by
``2^(bits-1)``, the kernel's implied zero point), input columns in group order (act-order
weights keep the permutation and gather x's columns with it), scales ``[G, N]``.
"""

from __future__ import annotations

import torch

from bladellm.quantization.cpu_kernels import _sorted_columns
from bladellm.quantization.int_weight import IntWeight


class TritonWeightOnlyLinear:
    """W4A16 / W8A16 through ``wna16_gemm``."""

    name = "triton-wna16"

    def __init__(self, w: IntWeight) -> None:
        from bladellm.kernels.triton.quant_gemm import pack_wna16

        w, self.perm, self.group_size = _sorted_columns(w)
        self.bits = w.bits
        q = w.q.to(torch.int32)
        offset = 1 << (w.bits - 1)
        if w.zeros is None:  # signed codes, zero point 0 -> unsigned codes, implied zero
            q = q + offset
            self.zeros = None
        else:
            zeros = w.zeros.to(torch.int32)
            if int(q.min()) < 0:  # signed codes with zero points (compressed-tensors asym)
                q, zeros = q + offset, zeros + offset
            self.zeros = zeros.t().contiguous()
        self.packed = pack_wna16(q.t().contiguous(), w.bits)
        # fp32 once here: the kernel reads scales as fp32 (no per-call cast, no rounding of
        # the checkpoint's scales to a 16-bit activation dtype).
        self.scales = w.scales.t().to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from bladellm.kernels.triton.quant_gemm import wna16_gemm

        rows = x.reshape(-1, x.shape[-1])
        if self.perm is not None:
            rows = rows.index_select(-1, self.perm)
        y = wna16_gemm(rows, self.packed, self.scales, self.zeros, self.bits, self.group_size,
                       bias)
        return y.reshape(*x.shape[:-1], -1)


class TritonW8A8Linear:
    """W8A8: per-token int8 activations (``per_token_quant_int8``) and ``w8a8_gemm``."""

    name = "triton-w8a8"

    def __init__(self, w: IntWeight) -> None:
        if w.num_groups != 1 or w.zeros is not None:
            raise ValueError("W8A8 needs symmetric per-channel weights")
        # [N, K] stored, [K, N] viewed: K-major, as the int8 tensor-core dot wants it.
        self.wq = w.q.to(torch.int8).contiguous().t()
        self.w_scale = w.scales[:, 0].to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from bladellm.kernels.triton.quant_gemm import per_token_quant_int8, w8a8_gemm

        rows = x.reshape(-1, x.shape[-1])
        xq, xs = per_token_quant_int8(rows)
        y = w8a8_gemm(xq, xs, self.wq, self.w_scale, x.dtype, bias)
        return y.reshape(*x.shape[:-1], -1)
