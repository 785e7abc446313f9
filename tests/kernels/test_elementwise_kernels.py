"""Compiled RMSNorm, rotary and SiLU-and-mul vs their reference twins: bit-identical in fp32
and bf16 (they replay torch's rounding, its summation order and its exp), on the strided views
the model hands them."""

from __future__ import annotations

import pytest
import torch

from bladellm.kernels import ref

DTYPES = [torch.float32, torch.bfloat16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, bit for bit (NaNs compare equal to each other: torch itself encodes a bf16 NaN
    differently in its scalar and vector paths)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        ((a == b) | (a.isnan() & b.isnan())).all())


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 64, 100, 8, 4096])
def test_rms_norm_bit_identical(compiled, dtype, hidden):
    x = randn(67, 2 * hidden, dtype=dtype)[:, :hidden]  # rows with a stride
    weight = randn(hidden, dtype=dtype, seed=1)
    residual = randn(67, hidden, dtype=dtype, seed=2)
    assert same_bits(compiled.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    got, got_res = compiled.fused_add_rms_norm(x, residual, weight, 1e-6)
    want, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert same_bits(got, want) and same_bits(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_view(compiled, dtype):
    """Qwen3's q/k norm: a [T, heads, head_dim] view of the fused qkv output, and 1-D input."""
    qkv = randn(9, 8 * 128, dtype=dtype)
    q = qkv[:, :4 * 128].view(9, 4, 128)
    weight = randn(128, dtype=dtype, seed=1)
    assert same_bits(compiled.rms_norm(q, weight, 1e-6), ref.rms_norm(q, weight, 1e-6))
    assert same_bits(compiled.rms_norm(q[0, 0], weight, 1e-6), ref.rms_norm(q[0, 0], weight, 1e-6))


def test_rms_norm_mixed_dtypes_fall_back(compiled):
    x, weight = randn(3, 64, dtype=torch.bfloat16), randn(64, dtype=torch.float32)
    assert same_bits(compiled.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    x16 = randn(3, 64, dtype=torch.float16)
    w16 = weight.half()
    assert same_bits(compiled.rms_norm(x16, w16, 1e-6), ref.rms_norm(x16, w16, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (128, 64), (64, 16),
                                                 (80, 40)])
def test_rotary_bit_identical(compiled, dtype, head_dim, rotary_dim):
    T, nh, kvh, max_pos = 37, 6, 2, 300
    qkv = randn(T, (nh + 2 * kvh) * head_dim, dtype=dtype)
    q, k = qkv[:, :nh * head_dim], qkv[:, nh * head_dim:(nh + kvh) * head_dim]
    positions = torch.randint(0, max_pos, (T,), generator=torch.Generator().manual_seed(3))
    cos = randn(max_pos, rotary_dim // 2, dtype=dtype, seed=4)
    sin = randn(max_pos, rotary_dim // 2, dtype=dtype, seed=5)
    q0, k0 = q.clone(), k.clone()
    want_q, want_k = ref.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                                          inplace=False)
    got_q, got_k = compiled.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                                             inplace=False)
    assert same_bits(got_q, want_q) and same_bits(got_k, want_k)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place leaves the inputs alone
    got_q, got_k = compiled.rotary_embedding(positions.int(), q, k, cos, sin, head_dim,
                                             rotary_dim)
    assert got_q is q and got_k is k  # in place: the views themselves now hold the result
    assert same_bits(q, want_q) and same_bits(k, want_k)


def test_rotary_rejects_positions_past_the_table(compiled):
    q, k = randn(2, 64, dtype=torch.float32), randn(2, 64, dtype=torch.float32)
    cos, sin = randn(10, 32, dtype=torch.float32), randn(10, 32, dtype=torch.float32)
    q0 = q.clone()
    with pytest.raises(IndexError):
        compiled.rotary_embedding(torch.tensor([3, 10]), q, k, cos, sin, 64, 64)
    assert torch.equal(q, q0)  # nothing written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2048, 100, 8, 33])
def test_silu_and_mul_bit_identical(compiled, dtype, d):
    x = randn(41, 2 * d + 6, dtype=dtype, scale=6.0)[:, :2 * d]  # strided rows
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -200.0])
    assert same_bits(compiled.silu_and_mul(x), ref.silu_and_mul(x))
    x3 = randn(2, 3, 2 * d, dtype=dtype, scale=3.0)
    assert same_bits(compiled.silu_and_mul(x3), ref.silu_and_mul(x3))
