"""Compiled activations (plain and gated), (1 + w) RMSNorm, LayerNorm and interleaved rotary
against their twins in kernels/ref.py. SiLU, ReLU, the (1 + w) RMSNorm and rotary reproduce the
twins bit for bit; the GELUs (torch's erf polynomial / a tanh from SLEEF's exp) and LayerNorm
(two passes, not torch's Welford) agree to float rounding."""

from __future__ import annotations

import pytest
import torch

from bladellm.kernels import ref

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 4e-6 if dtype == torch.float32 else 1.6e-2  # a few fp32 ulps; two bf16 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ref.ACTIVATIONS)
@pytest.mark.parametrize("d", [200, 37, 1024])
def test_gated_activation_matches_twin(compiled, dtype, act, d):
    if act == "gelu_new" and dtype != torch.float32:
        pytest.skip("16-bit gelu_new runs its twin (transformers rounds it op by op)")
    x = randn(9, 2 * d, dtype=dtype, scale=3.0)
    got, want = compiled.act_and_mul(x, act), ref.act_and_mul(x, act)
    if act in ("silu", "relu"):
        assert torch.equal(got, want)
    else:
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu_new"])  # plain relu, gelu: torch's
def test_plain_activation_matches_twin(compiled, dtype, act):
    if act == "gelu_new" and dtype != torch.float32:
        pytest.skip("16-bit gelu_new runs its twin (transformers rounds it op by op)")
    x = randn(3, 5, 300, dtype=dtype, scale=3.0)  # 3-D, as a model may hand it
    got, want = compiled.activation(x, act), ref.activation(x, act)
    close(got, want, dtype)
    strided = randn(6, 128, dtype=dtype, seed=1)[:, :100]  # rows with a stride
    close(compiled.activation(strided, act), ref.activation(strided, act), dtype)


def test_gated_relu_keeps_nan(compiled):
    gate = torch.tensor([[float("nan"), -1.0, 2.0, 0.0] * 8])
    out = compiled.act_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=-1), "relu")
    assert torch.equal(out.isnan(), gate.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 768])
def test_unit_offset_rms_norm_bit_identical(compiled, dtype, hidden):
    x = randn(33, 2 * hidden, dtype=dtype)[:, :hidden]
    weight = randn(hidden, dtype=dtype, seed=1, scale=0.1)
    residual = randn(33, hidden, dtype=dtype, seed=2)
    assert torch.equal(compiled.rms_norm_unit_offset(x, weight, 1e-6),
                       ref.rms_norm_unit_offset(x, weight, 1e-6))
    got, got_res = compiled.fused_add_rms_norm_unit_offset(x, residual, weight, 1e-6)
    want, want_res = ref.fused_add_rms_norm_unit_offset(x, residual, weight, 1e-6)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 768])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_twin(compiled, dtype, hidden, with_bias):
    x = randn(33, 2 * hidden, dtype=dtype, scale=2.0)[:, :hidden] + 0.5
    weight = randn(hidden, dtype=dtype, seed=1)
    bias = randn(hidden, dtype=dtype, seed=3) if with_bias else None
    residual = randn(33, hidden, dtype=dtype, seed=2)
    close(compiled.layer_norm(x, weight, bias, 1e-5), ref.layer_norm(x, weight, bias, 1e-5),
          dtype)
    got, got_res = compiled.fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    want, want_res = ref.fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    close(got, want, dtype)
    assert torch.equal(got_res, want_res)
    few = x[:3]  # decode-sized: F.layer_norm (the reference) runs
    close(compiled.layer_norm(few, weight, bias, 1e-5), ref.layer_norm(few, weight, bias, 1e-5),
          dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 32), (128, 128), (80, 40)])
def test_interleaved_rotary_bit_identical(compiled, dtype, head_dim, rotary_dim):
    T, nh, kvh, max_pos = 21, 4, 2, 100
    qkv = randn(T, (nh + 2 * kvh) * head_dim, dtype=dtype)
    q, k = qkv[:, :nh * head_dim], qkv[:, nh * head_dim:(nh + kvh) * head_dim]
    positions = torch.randint(0, max_pos, (T,), generator=torch.Generator().manual_seed(3))
    cos = randn(max_pos, rotary_dim // 2, dtype=dtype, seed=4)
    sin = randn(max_pos, rotary_dim // 2, dtype=dtype, seed=5)
    want = ref.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                                inplace=False, interleaved=True)
    got = compiled.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                                    inplace=False, interleaved=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    neox = ref.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim, inplace=False)
    assert not torch.equal(neox[0], want[0])  # the layouts really differ
    compiled.rotary_embedding(positions, q, k, cos, sin, head_dim, rotary_dim,
                              interleaved=True)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_interleaved_twin_is_transformers_glm_rotary():
    """The twin's interleaved layout is transformers' GLM apply_rotary_pos_emb."""
    glm = pytest.importorskip("transformers.models.glm.modeling_glm")
    T, nh, head_dim, rotary_dim = 5, 2, 16, 8
    q, k = randn(T, nh * head_dim, dtype=torch.float32), randn(T, nh * head_dim,
                                                               dtype=torch.float32, seed=1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    want_q, want_k = glm.apply_rotary_pos_emb(
        q.view(T, nh, head_dim).transpose(0, 1)[None], k.view(T, nh, head_dim).transpose(0, 1)[None],
        emb.cos()[None], emb.sin()[None])
    got_q, got_k = ref.rotary_embedding(torch.arange(T), q, k, freqs.cos(), freqs.sin(), head_dim,
                                        rotary_dim, inplace=False, interleaved=True)
    assert torch.equal(got_q, want_q[0].transpose(0, 1).reshape(T, -1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1).reshape(T, -1))


def test_twins_are_transformers_activations():
    acts = pytest.importorskip("transformers.activations")
    x = randn(4, 64, dtype=torch.float32, scale=3.0)
    for hf_name, name in (("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"),
                          ("gelu_new", "gelu_new"), ("relu", "relu"), ("silu", "silu")):
        assert torch.equal(ref.activation(x, name), acts.ACT2FN[hf_name](x)), hf_name
