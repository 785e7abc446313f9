"""Every CPU kernel against its plain-PyTorch twin: weight-only kernels against F.linear on
``dequantize(w)``; the int8 W8A8 kernel against ``w8a8_reference`` (exact integer sums)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bladellm.kernels import resolve_kernels
from bladellm.quantization import cpu_kernels
from bladellm.quantization.cpu_kernels import (AtenInt4Linear, DequantLinear, Int8DynamicLinear,
                                               choose_w8a8_kernel,
                                               int8_gemm_accumulates_in_32_bits,
                                               choose_weight_only_kernel, has_fbgemm,
                                               quantize_per_token, w8a8_reference)
from bladellm.quantization.int_weight import IntWeight, dequantize, unpack_int32

# The kernel set a CPU worker resolves for --kernels auto (the layers hand theirs in).
KERNELS = resolve_kernels("auto", "cpu")


def _weight(n: int, k: int, bits: int, group: int, zeros: bool, signed: bool = False,
            act_order: bool = False, seed: int = 0) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    groups = k // group
    q = torch.randint(lo, hi, (n, k), generator=gen).to(torch.int16)
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.01
    z = torch.randint(lo, hi, (n, groups), generator=gen).to(torch.int16) if zeros else None
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return IntWeight(q, scales, z, g_idx, bits)


CASES = {
    "4bit-g32-zeros": dict(bits=4, group=32, zeros=True),
    "4bit-g64-signed-sym": dict(bits=4, group=64, zeros=False, signed=True),
    "4bit-channel": dict(bits=4, group=128, zeros=True),
    "4bit-act-order": dict(bits=4, group=32, zeros=True, act_order=True),
    "8bit-g32-unsigned": dict(bits=8, group=32, zeros=True),
    "8bit-channel-signed": dict(bits=8, group=128, zeros=False, signed=True),
    # compressed-tensors asymmetric: signed codes and signed zero points
    "4bit-g32-signed-zeros": dict(bits=4, group=32, zeros=True, signed=True),
    "8bit-g64-signed-zeros": dict(bits=8, group=64, zeros=True, signed=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_weight_only_kernels_match_the_twin(case, rows):
    w = _weight(48, 128, **CASES[case])
    x = torch.randn(rows, 128)
    bias = torch.randn(48)
    want = F.linear(x, dequantize(w), bias)
    dequant = DequantLinear(w, KERNELS)
    torch.testing.assert_close(dequant(x, bias), want, atol=1e-5, rtol=1e-5)
    kernel = choose_weight_only_kernel(w, KERNELS)
    torch.testing.assert_close(kernel(x, bias), want, atol=1e-5, rtol=1e-5)
    # 3-D activations (batch, tokens, features) keep their leading shape.
    torch.testing.assert_close(dequant(x.view(1, rows, 128), None),
                               F.linear(x, dequantize(w)).view(1, rows, 48),
                               atol=1e-5, rtol=1e-5)


def test_aten_int4_matches_the_twin_where_it_applies():
    w = _weight(64, 256, bits=4, group=64, zeros=True)
    assert AtenInt4Linear.unsupported(w) is None
    kernel = AtenInt4Linear(w, DequantLinear(w, KERNELS))
    x = torch.randn(1, 256)
    got = torch._weight_int4pack_mm_for_cpu(x, kernel.packed, 64, kernel.scales_and_zeros)
    torch.testing.assert_close(got, x @ dequantize(w).t(), atol=1e-4, rtol=1e-4)
    # Shapes ATen cannot take.
    assert AtenInt4Linear.unsupported(_weight(40, 256, bits=4, group=64, zeros=True))
    assert AtenInt4Linear.unsupported(_weight(64, 256, bits=4, group=16, zeros=True))
    assert AtenInt4Linear.unsupported(_weight(64, 128, bits=4, group=32, zeros=True,
                                              act_order=True))
    # On AVX2 the engine picks dequant + GEMM (measured faster at every M).
    if cpu_kernels.ATEN_INT4_MAX_ROWS == 0:
        assert isinstance(choose_weight_only_kernel(w, KERNELS), DequantLinear)


def test_dequant_layout_is_4_bits_per_weight():
    w = _weight(64, 256, bits=4, group=32, zeros=True)
    kernel = DequantLinear(w, KERNELS)
    assert kernel.codes.dtype == torch.uint8 and kernel.codes.numel() == 64 * 128
    torch.testing.assert_close(kernel.weight(torch.float32), dequantize(w), atol=0, rtol=0)


@pytest.mark.skipif(not has_fbgemm(), reason="this torch build has no fbgemm")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_w8a8_kernel_is_exact_against_the_twin(rows):
    # Full-range int8 weights and outlier activations: the case where a saturating 16-bit
    # pair sum (AVX2 u8 x s8) would show.
    w = _weight(96, 512, bits=8, group=512, zeros=False, signed=True)
    x = torch.randn(rows, 512)
    x[:, :4] *= 50
    bias = torch.randn(96)
    want = w8a8_reference(x, w, bias)
    got = Int8DynamicLinear(w)(x, bias)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)


@pytest.mark.skipif(not has_fbgemm() or not int8_gemm_accumulates_in_32_bits(),
                    reason="needs fbgemm on AVX-512 VNNI (32-bit accumulation)")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_w8a8_vnni_kernel_without_split_is_exact(rows):
    """On VNNI the full-range codes go in as they are (zero point 128): still exact."""
    w = _weight(96, 512, bits=8, group=512, zeros=False, signed=True)
    x = torch.randn(rows, 512)
    x[:, :4] *= 50
    bias = torch.randn(96)
    kernel = Int8DynamicLinear(w, split=False)
    torch.testing.assert_close(kernel(x, bias), w8a8_reference(x, w, bias), atol=1e-3,
                               rtol=1e-5)


@pytest.mark.skipif(not has_fbgemm(), reason="this torch build has no fbgemm")
def test_w8a8_kernel_choice_follows_the_isa():
    w = _weight(32, 64, bits=8, group=64, zeros=False, signed=True)
    avx2 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    assert choose_w8a8_kernel(w, avx2).split
    vnni = choose_w8a8_kernel(w, avx2 | {"avx512_vnni"})
    assert not vnni.split and vnni.name == "fbgemm-int8-vnni"


def test_w8a8_twin_quantizes_activations_per_token():
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 50.0, -25.0]])
    xq, xs = quantize_per_token(x)
    assert xq.abs().amax(dim=1).tolist() == [127.0, 127.0]
    torch.testing.assert_close(xq * xs, x, atol=float(xs.max()) / 2, rtol=0)


def test_unpack_int32_orders():
    word = torch.tensor([[0x76543210]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(word, 4, dim=1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # AWQ: nibble j holds column [0, 2, 4, 6, 1, 3, 5, 7][j], so column c sits in nibble
    # [0, 4, 1, 5, 2, 6, 3, 7][c] (here: nibble j holds the value j)
    awq = unpack_int32(word, 4, dim=1, order=[0, 4, 1, 5, 2, 6, 3, 7])
    assert awq.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    top = torch.tensor([[-1]], dtype=torch.int32)  # sign bit set: still unsigned nibbles
    assert unpack_int32(top, 4, dim=0).flatten().tolist() == [15] * 8
    assert unpack_int32(top, 8, dim=0).flatten().tolist() == [255] * 4
