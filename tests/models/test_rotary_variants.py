"""LongRoPE (Phi-3's ``longrope`` / ``su``) and partial rotary against transformers' own rotary
modules; one-line errors for rope configurations we cannot run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from bladellm.model.layers.rotary import get_rope, rope_parameters_from_config

pytestmark = pytest.mark.usefixtures("layer_kernels")

ORIG, MAX_POS, HEAD_DIM = 32, 128, 32


def phi3_config(rope_type: str = "longrope", partial: float = 1.0, **extra):
    dim = int(HEAD_DIM * partial)
    g = torch.Generator().manual_seed(0)
    scaling = {"type": rope_type,
               "short_factor": (1 + torch.rand(dim // 2, generator=g)).tolist(),
               "long_factor": (1 + 4 * torch.rand(dim // 2, generator=g)).tolist(), **extra}
    return transformers.Phi3Config(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POS, original_max_position_embeddings=ORIG,
        rope_scaling=scaling, partial_rotary_factor=partial)


def hf_rotate(config, q, k, positions):
    rope = Phi3RotaryEmbedding(config)
    cos, sin = rope(q, positions[None])
    qr, kr = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return qr[0].transpose(0, 1), kr[0].transpose(0, 1)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_factors_match_transformers(partial):
    """A sequence within original_max_position_embeddings: short factors, and the attention
    factor sqrt(1 + ln(max / orig) / ln(orig)) on cos and sin."""
    config = phi3_config("longrope", partial)
    rope = get_rope(config, HEAD_DIM, torch.float32)
    assert rope.rotary_dim == int(HEAD_DIM * partial)
    q, k = torch.randn(ORIG, 4, HEAD_DIM), torch.randn(ORIG, 2, HEAD_DIM)
    positions = torch.arange(ORIG)
    ours_q, ours_k = rope(positions, q.reshape(ORIG, -1), k.reshape(ORIG, -1))
    want_q, want_k = hf_rotate(config, q, k, positions)
    torch.testing.assert_close(ours_q.view(ORIG, 4, HEAD_DIM), want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k.view(ORIG, 2, HEAD_DIM), want_k, atol=1e-6, rtol=0)


def test_longrope_long_factors_match_token_by_token_decode():
    """Past the original length transformers switches to the long factors: a token decoded at
    position p (sequence length p + 1) gets them from p = orig on."""
    config = phi3_config(attention_factor=1.3)
    rope = get_rope(config, HEAD_DIM, torch.float32)
    for pos in (ORIG - 1, ORIG, MAX_POS - 1):
        q, k = torch.randn(1, 4, HEAD_DIM), torch.randn(1, 2, HEAD_DIM)
        ours_q, _ = rope(torch.tensor([pos]), q.reshape(1, -1), k.reshape(1, -1))
        want_q, _ = hf_rotate(config, q, k, torch.tensor([pos]))
        torch.testing.assert_close(ours_q.view(1, 4, HEAD_DIM), want_q, atol=1e-6, rtol=0)


def test_longrope_factor_lengths_are_checked():
    config = phi3_config()
    config.rope_parameters["short_factor"] = config.rope_parameters["short_factor"][:3]
    with pytest.raises(ValueError, match="short_factor has 3 entries"):
        get_rope(config, HEAD_DIM, torch.float32)


def test_su_is_longrope():
    """Early Phi-3 configs spell LongRoPE "su" (in rope_scaling's "type")."""
    cfg = SimpleNamespace(rope_theta=10.0, max_position_embeddings=64,
                          original_max_position_embeddings=16,
                          rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]})
    params = rope_parameters_from_config(cfg)
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 16


def test_longrope_without_factors_is_a_clear_error():
    cfg = SimpleNamespace(rope_theta=1.0, max_position_embeddings=8,
                          rope_scaling={"type": "longrope", "long_factor": [1.0]})
    with pytest.raises(ValueError, match="longrope.*short_factor"):
        rope_parameters_from_config(cfg)


def test_partial_rotary_leaves_the_rest_of_the_head():
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                                   max_position_embeddings=64)
    cfg.partial_rotary_factor = 0.5
    rope = get_rope(cfg, 32, torch.float32, interleaved=True)
    assert rope.rotary_dim == 16 and rope.interleaved
    q, k = torch.randn(5, 4 * 32), torch.randn(5, 2 * 32)
    ours_q, ours_k = rope(torch.arange(5), q, k)
    assert torch.equal(ours_q.view(5, 4, 32)[..., 16:], q.view(5, 4, 32)[..., 16:])
    assert not torch.equal(ours_q.view(5, 4, 32)[1:, :, :16], q.view(5, 4, 32)[1:, :, :16])


def test_odd_rotary_dimension_is_a_clear_error():
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                                   max_position_embeddings=64)
    cfg.partial_rotary_factor = 0.3  # 9.6 -> 9 dims
    with pytest.raises(ValueError, match="partial_rotary_factor 0.3 .* rotary dimension of 9"):
        get_rope(cfg, 32, torch.float32)
