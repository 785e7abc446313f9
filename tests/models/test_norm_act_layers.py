"""The config-chosen layers against transformers' own modules: activations by ``hidden_act``
name (gated and plain), the (1 + w) RMSNorm against Gemma's, LayerNorm against nn.LayerNorm,
each with the fused residual add; one-line errors for unknown names; dummy weights give the
identity scale."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

from bladellm.model.layers import LayerNorm, UnitOffsetRMSNorm, get_act_fn
from bladellm.model.layers.activation import HF_ACTIVATIONS
from bladellm.model.loader import init_dummy_weights

pytestmark = pytest.mark.usefixtures("layer_kernels")
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("name", list(HF_ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_match_transformers(name, dtype):
    x = _randn(7, 2 * 48, dtype=dtype, scale=3.0)
    gate, up = x.chunk(2, dim=-1)
    want_gated = ACT2FN[name](gate) * up
    want_plain = ACT2FN[name](x)
    got_gated, got_plain = get_act_fn(name, gated=True)(x), get_act_fn(name, gated=False)(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the GELUs: an ulp of the dtype
    torch.testing.assert_close(got_gated.float(), want_gated.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_plain.float(), want_plain.float(), atol=tol, rtol=tol)
    if name in ("silu", "swish", "relu"):
        assert torch.equal(got_gated, want_gated) and torch.equal(got_plain, want_plain)


def test_unknown_activation_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^unsupported activation 'quick_gelu' "
                                         r"\(activation_function in config.json\); supported: "):
        get_act_fn("quick_gelu", gated=False, field="activation_function")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_rms_norm_matches_gemma(dtype):
    theirs = Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(_randn(96, seed=1, scale=0.3))
    theirs = theirs.to(dtype)
    ours = UnitOffsetRMSNorm(96, 1e-6, params_dtype=dtype)
    ours.weight.data.copy_(theirs.weight)
    x, residual = _randn(5, 96, dtype=dtype, seed=2), _randn(5, 96, dtype=dtype, seed=3)
    assert torch.equal(ours(x), theirs(x))
    got, got_res = ours(x, residual)
    assert torch.equal(got_res, x + residual) and torch.equal(got, theirs(x + residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_torch(dtype, bias):
    theirs = nn.LayerNorm(80, eps=1e-5, bias=bias)
    with torch.no_grad():
        theirs.weight.copy_(_randn(80, seed=1, scale=0.5) + 1)
        if bias:
            theirs.bias.copy_(_randn(80, seed=4, scale=0.5))
    theirs = theirs.to(dtype)
    ours = LayerNorm(80, 1e-5, bias=bias, params_dtype=dtype)
    ours.weight.data.copy_(theirs.weight)
    if bias:
        ours.bias.data.copy_(theirs.bias)
    x, residual = _randn(6, 80, dtype=dtype, seed=2) + 0.3, _randn(6, 80, dtype=dtype, seed=3)
    tol = 4e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(ours(x).float(), theirs(x).float(), atol=tol, rtol=tol)
    got, got_res = ours(x, residual)
    assert torch.equal(got_res, x + residual)
    torch.testing.assert_close(got.float(), theirs(x + residual).float(), atol=tol, rtol=tol)


def test_dummy_weights_are_the_identity_scale():
    model = nn.Module()
    model.input_layernorm = UnitOffsetRMSNorm(16)
    model.final_layer_norm = LayerNorm(16)
    init_dummy_weights(model)
    assert torch.equal(model.input_layernorm.weight, torch.zeros(16))
    assert torch.equal(model.final_layer_norm.weight, torch.ones(16))
    assert torch.equal(model.final_layer_norm.bias, torch.zeros(16))
