"""Triton activations (plain and gated), (1 + w) RMSNorm, LayerNorm and interleaved rotary
(bladellm/kernels/triton/elementwise.py) against their twins in kernels/ref.py: on a GPU when
there is one, otherwise under ``TRITON_INTERPRET=1`` (whose bf16 cast truncates: bf16 is held to
a bf16 ulp or two there)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")

from bladellm.kernels import ref  # noqa: E402
from bladellm.kernels.triton import elementwise as ew  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 4e-6 if want.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ref.ACTIVATIONS)
def test_activations_match_twin(dtype, act):
    x = _randn(5, 2 * 40, dtype=dtype, scale=3.0)
    _close(ew.act_and_mul(x, act, block=16), ref.act_and_mul(x, act))
    _close(ew.activation(x, act), ref.activation(x, act))


def test_activation_rejects_unknown():
    with pytest.raises(ValueError, match="swiglu"):
        ew.activation(torch.zeros(2, 8, device=DEVICE), "swiglu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_rms_norm_matches_twin(dtype):
    x = _randn(2, 5, 80, dtype=dtype, scale=2.0)[:, :, :40]
    residual = _randn(2, 5, 40, dtype=dtype, seed=1)
    weight = _randn(40, dtype=dtype, seed=2, scale=0.1)
    _close(ew.rms_norm_unit_offset(x, weight, 1e-6), ref.rms_norm_unit_offset(x, weight, 1e-6))
    got, got_res = ew.fused_add_rms_norm_unit_offset(x, residual, weight, 1e-6)
    want, want_res = ref.fused_add_rms_norm_unit_offset(x, residual, weight, 1e-6)
    _close(got, want)
    _close(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_twin(dtype, with_bias):
    x = _randn(7, 48, dtype=dtype, scale=2.0) + 0.5
    residual = _randn(7, 48, dtype=dtype, seed=1)
    weight = _randn(48, dtype=dtype, seed=2)
    bias = _randn(48, dtype=dtype, seed=3) if with_bias else None
    _close(ew.layer_norm(x, weight, bias, 1e-5), ref.layer_norm(x, weight, bias, 1e-5))
    got, got_res = ew.fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    want, want_res = ref.fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    _close(got, want)
    _close(got_res, want_res)


def test_layer_norm_rejects_bad_bias():
    with pytest.raises(ValueError, match="bias"):
        ew.layer_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                      torch.ones(4, device=DEVICE), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_matches_twin(dtype):
    T, nh, kvh, head_dim, rotary_dim, max_pos = 6, 3, 1, 32, 16, 20
    qkv = _randn(T, (nh + 2 * kvh) * head_dim, dtype=dtype)
    q, k = qkv[:, :nh * head_dim], qkv[:, nh * head_dim:(nh + kvh) * head_dim]
    positions = torch.tensor([0, 3, 19, 7, 7, 1], device=DEVICE)
    cos = _randn(max_pos, rotary_dim // 2, dtype=dtype, seed=4)
    sin = _randn(max_pos, rotary_dim // 2, dtype=dtype, seed=5)
    want = ref.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim, inplace=False,
                                interleaved=True)
    got = ew.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim, inplace=False,
                              interleaved=True)
    _close(got[0], want[0])
    _close(got[1], want[1])
