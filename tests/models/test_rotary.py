"""Rotary tables vs transformers' LlamaRotaryEmbedding for every supported scaling type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from bladellm.model.layers.rotary import get_rope, rope_parameters_from_config

# The rotary layer takes the kernel set of the model being built: --kernels auto's here.
pytestmark = pytest.mark.usefixtures("layer_kernels")

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
}
MAX_POS = 128


def hf_config(scaling, head_dim=32):
    return transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=MAX_POS, rope_theta=500.0,
        rope_scaling=dict(scaling) if scaling else None)


def hf_rotate(config, q, k, positions):
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # transformers layout: [1, heads, T, d]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    qr, kr = apply_rotary_pos_emb(qh, kh, cos, sin)
    return qr[0].transpose(0, 1), kr[0].transpose(0, 1)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rotary_matches_transformers(kind):
    config = hf_config(SCALINGS[kind])
    rope = get_rope(config, config.head_dim, torch.float32)
    T = MAX_POS
    positions = torch.arange(T)
    q, k = torch.randn(T, 4, 32), torch.randn(T, 2, 32)
    ours_q, ours_k = rope(positions, q.reshape(T, -1), k.reshape(T, -1))
    want_q, want_k = hf_rotate(config, q, k, positions)
    torch.testing.assert_close(ours_q.view(T, 4, 32), want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k.view(T, 2, 32), want_k, atol=1e-6, rtol=0)


def test_dynamic_ntk_beyond_max_positions_matches_incremental_decode():
    """Past max_position_embeddings transformers rescales for seq_len = position + 1: the
    frequencies a token gets when decoded one at a time."""
    config = hf_config(SCALINGS["dynamic"])
    rope = get_rope(config, config.head_dim, torch.float32)
    assert rope.max_position == 2 * MAX_POS
    for pos in (MAX_POS, MAX_POS + 37, 2 * MAX_POS - 1):
        q, k = torch.randn(1, 4, 32), torch.randn(1, 2, 32)
        ours_q, _ = rope(torch.tensor([pos]), q.reshape(1, -1), k.reshape(1, -1))
        hf = LlamaRotaryEmbedding(config)
        cos, sin = hf(q, torch.arange(pos + 1)[None])  # the forward that decodes `pos`
        want_q, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         cos[:, -1:], sin[:, -1:])
        torch.testing.assert_close(ours_q.view(1, 4, 32), want_q[0].transpose(0, 1),
                                   atol=1e-5, rtol=0)


def test_old_style_config_fields():
    """rope_theta + rope_scaling attributes (pre-transformers-5 configs) are understood."""
    old = SimpleNamespace(rope_theta=1234.0, max_position_embeddings=64,
                          rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters_from_config(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 1234.0
    assert params["factor"] == 2.0
    plain = rope_parameters_from_config(SimpleNamespace(rope_theta=99.0,
                                                        max_position_embeddings=64))
    assert plain == {"rope_type": "default", "rope_theta": 99.0}
    new = rope_parameters_from_config(hf_config(SCALINGS["llama3"]))
    assert new["rope_type"] == "llama3" and new["rope_theta"] == 500.0


def test_unsupported_rope_type_is_a_clear_error():
    cfg = SimpleNamespace(rope_theta=1.0, max_position_embeddings=8,
                          rope_scaling={"rope_type": "fancy_rope", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope type 'fancy_rope'.*supported"):
        rope_parameters_from_config(cfg)
