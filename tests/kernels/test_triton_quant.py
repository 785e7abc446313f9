"""Triton quantized GEMMs (bladellm/kernels/triton/quant_gemm.py) against their PyTorch twins:
on a GPU when there is one, otherwise under ``TRITON_INTERPRET=1`` at small shapes (CI)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before anything imports triton.
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels.triton import quant_gemm as qg  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def _random_wna16(k: int, n: int, bits: int, group_size: int, with_zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (k, n), generator=g)
    scales = torch.rand(k // group_size, n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (k // group_size, n), generator=g,
                          dtype=torch.int32) if with_zeros else None
    return values, scales, zeros


def test_pack_then_unpack_is_identity():
    for bits in (4, 8):
        values, _, _ = _random_wna16(64, 24, bits, 32, False, 0)
        packed = qg.pack_wna16(values, bits)
        assert packed.dtype == torch.int32 and packed.shape == (64 // (32 // bits), 24)
        assert torch.equal(qg.unpack_wna16_ref(packed, bits), values)


@pytest.mark.parametrize("bits, group_size, with_zeros, m, k, n, block_k, split", [
    (4, 32, True, 3, 128, 40, 128, 1),    # asym, groups of 32 inside the K tile, ragged M and N
    (4, 128, False, 17, 128, 64, 128, 1),  # sym (zero point 8), per channel (group = K)
    (8, 64, True, 1, 192, 24, 64, 1),     # 8-bit, decode-sized M, K not a power of two
    (8, 64, False, 5, 64, 16, 64, 1),
    (4, 16, True, 2, 256, 24, 128, 1),    # groups of 16: two words per group
    (4, 32, True, 3, 384, 40, 128, 2),    # split-K: 3 K tiles over 2 slices (2, 1)
    (8, 192, False, 4, 192, 24, 64, 2),   # split-K, per channel, K tile 64 in a group of 192
    (4, 64, True, 2, 192, 24, 128, 1),    # K not a multiple of the K tile: a masked last tile
])
def test_wna16_matches_twin(bits, group_size, with_zeros, m, k, n, block_k, split):
    values, scales, zeros = _random_wna16(k, n, bits, group_size, with_zeros, k + n)
    qweight = qg.pack_wna16(values, bits).to(DEVICE)
    scales, zeros = scales.to(DEVICE), zeros.to(DEVICE) if zeros is not None else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    bias = torch.randn(n).to(DEVICE)
    got = qg.wna16_gemm(x, qweight, scales, zeros, bits, group_size, bias=bias,
                        tiles=qg.GemmTiles(16, 16, block_k, split))
    want = qg.wna16_gemm_ref(x, qweight, scales, zeros, bits, group_size, bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The twin itself against an explicit dequantization.
    zero = zeros.float().repeat_interleave(group_size, 0) if zeros is not None else 2 ** (bits - 1)
    w = (values.to(DEVICE).float() - zero) * scales.float().repeat_interleave(group_size, 0)
    torch.testing.assert_close(want, x @ w + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits, group_size", [(4, 64), (4, 128), (8, 64)])
def test_wna16_16bit_activations(dtype, bits, group_size):
    """16-bit activations take the tensor-core dot (4-bit values made 16-bit floats by bit
    operations; groups as large as the K tile scale the tile's dot once): within the rounding
    of x and the 16-bit weights of the float32 twin."""
    k, n, m = 256, 48, 5
    values, scales, zeros = _random_wna16(k, n, bits, group_size, True, 7)
    qweight = qg.pack_wna16(values, bits).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    got = qg.wna16_gemm(x, qweight, scales.to(DEVICE), zeros.to(DEVICE), bits, group_size)
    assert got.dtype == dtype
    want = qg.wna16_gemm_ref(x.float(), qweight, scales.to(DEVICE), zeros.to(DEVICE), bits,
                             group_size)
    err = (got.float() - want).norm() / want.norm()
    assert err < (6e-3 if dtype == torch.bfloat16 else 8e-4), err


@pytest.mark.parametrize("bits, group_size, with_zeros", [(4, 32, True), (8, 48, False)])
def test_dequant_wna16_matches_twin(bits, group_size, with_zeros):
    k, n = 96, 40
    values, scales, zeros = _random_wna16(k, n, bits, group_size, with_zeros, 5)
    qweight = qg.pack_wna16(values, bits).to(DEVICE)
    zeros = zeros.to(DEVICE) if zeros is not None else None
    got = qg.dequant_wna16(qweight, scales.to(DEVICE), zeros, bits, group_size, torch.float32)
    zero = zeros.float().repeat_interleave(group_size, 0) if zeros is not None else 2 ** (bits - 1)
    want = (values.to(DEVICE).float() - zero) * scales.to(DEVICE).repeat_interleave(group_size, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_choose_tiles():
    cpu = torch.device("cpu")
    decode = qg.choose_tiles(1, 4096, 4096, cpu, k_align=128)
    assert (decode.block_m, decode.block_k, decode.split_k) == (16, 128, 1)  # no split off GPU
    assert qg.choose_tiles(1, 4096, 4096, cpu, k_align=32).block_k == 32  # tile inside a group
    assert qg.choose_tiles(1, 4096, 192, cpu, k_align=192).block_k == 64
    assert qg.choose_tiles(40, 4096, 4096, cpu).block_m == 64
    big = qg.choose_tiles(512, 4096, 4096, cpu)
    assert (big.block_m, big.block_n, big.num_warps) == (128, 128, 8)
    if ON_GPU:  # decode at N = 4096 leaves 64 output tiles: split K to fill the multiprocessors
        assert qg.choose_tiles(1, 4096, 11008, torch.device("cuda"), k_align=128).split_k > 1


def test_wna16_rejects_bad_shapes():
    values, scales, _ = _random_wna16(64, 16, 4, 32, False, 1)
    qweight = qg.pack_wna16(values, 4)
    with pytest.raises(ValueError, match="packed rows"):
        qg.wna16_gemm(torch.randn(2, 32), qweight, scales, None, 4, 32)
    with pytest.raises(ValueError, match="scales"):
        qg.wna16_gemm(torch.randn(2, 64), qweight, scales[:1], None, 4, 32)
    with pytest.raises(ValueError, match="bits"):
        qg.wna16_gemm(torch.randn(2, 64), qweight, scales, None, 3, 32)
    with pytest.raises(ValueError, match="block_k"):
        qg.wna16_gemm(torch.randn(2, 64), qweight, scales, None, 4, 32,
                      tiles=qg.GemmTiles(16, 16, 64))


@pytest.mark.parametrize("m, k", [(1, 64), (7, 300)])
def test_per_token_quant_matches_twin(m, k):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3).to(DEVICE)
    x[0, 0] = 0.5 * x[0].abs().max() / 127 * 255  # lands on a rounding half-way point
    q, s = qg.per_token_quant_int8(x)
    q_ref, s_ref = qg.per_token_quant_int8_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1  # float division vs twin's: 1 ulp ties
    assert (q.int() != q_ref.int()).float().mean() < 0.01


@pytest.mark.parametrize("m, k, n, with_bias, split", [
    (3, 64, 40, True, 1), (17, 96, 16, False, 1), (3, 160, 40, True, 2)])
def test_w8a8_matches_twin_exactly(m, k, n, with_bias, split):
    g = torch.Generator().manual_seed(m * n)
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8).to(DEVICE)
    wq = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8).to(DEVICE)
    if split > 1:  # the layout the engine keeps: [N, K] stored, K-major [K, N] view
        wq = wq.t().contiguous().t()
    xs = (torch.rand(m, generator=g) * 0.01).to(DEVICE)
    ws = (torch.rand(n, generator=g) * 0.01).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE) if with_bias else None
    got = qg.w8a8_gemm(xq, xs, wq, ws, torch.float32, bias=bias,
                       tiles=qg.GemmTiles(16, 16, 32, split))
    want = qg.w8a8_gemm_ref(xq, xs, wq, ws, torch.float32, bias=bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
