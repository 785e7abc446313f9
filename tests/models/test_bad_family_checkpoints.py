"""Issue 32 item 5 for every family (test_bad_checkpoints.py covers Llama's layout and the
ChatGLM variants): an unknown activation or rope type in the family's own config.json field, a
missing tensor, a shape that disagrees with config.json — each a one-line ValueError naming it.
A family without the field (Bloom's fixed GELU and ALiBi, OPT's learned positions, ChatGLM's
fixed SwiGLU and rotary) has no such case."""

from __future__ import annotations

import pytest

from family_models import family_dirs
from test_bad_checkpoints import _copy, _drop_tensor, _one_line_error
from window_family_models import make_window_family_model

WINDOW_FAMILIES = ("gemma2", "gemma3", "bloom")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    families = family_dirs(tmp_path_factory)
    cache: dict = {}

    def get(variant: str) -> str:
        if variant not in WINDOW_FAMILIES:
            return families(variant)
        if variant not in cache:
            cache[variant] = make_window_family_model(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return get


# variant -> the config.json field naming its activation
ACTIVATION = {"opt": "activation_function", "phi3-longrope": "hidden_act", "glm": "hidden_act",
              "glm4": "hidden_act", "gemma2": "hidden_activation",
              "gemma3": "hidden_activation"}
_BAD_ROPE = {"rope_type": "mrope_x", "factor": 2.0, "rope_theta": 10000.0}
# variant -> config changes naming an unknown rope type
ROPE = {v: dict(rope_parameters=None, rope_scaling=_BAD_ROPE)
        for v in ("phi3-longrope", "glm", "glm4", "gemma2")}
ROPE["gemma3"] = dict(rope_parameters={"sliding_attention": _BAD_ROPE,
                                       "full_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}})
# variant -> (checkpoint tensor dropped, the parameter the error names)
MISSING = {
    "opt": ("model.decoder.layers.1.fc1.weight", "model.decoder.layers.1.fc1.weight"),
    "phi3-longrope": ("model.layers.1.mlp.down_proj.weight",
                      "model.layers.1.mlp.down_proj.weight"),
    "glm": ("model.layers.1.self_attn.v_proj.weight",
            "model.layers.1.self_attn.qkv_proj.weight (checkpoint: no "
            "model.layers.1.self_attn.v_proj.weight)"),
    "glm4": ("model.layers.0.post_mlp_layernorm.weight",
             "model.layers.0.post_mlp_layernorm.weight"),
    "chatglm": ("transformer.encoder.layers.1.mlp.dense_4h_to_h.weight", "layers.1.mlp.down_proj"),
    "gemma2": ("model.layers.1.post_feedforward_layernorm.weight",
               "model.layers.1.post_feedforward_layernorm.weight"),
    "gemma3": ("model.layers.2.self_attn.k_norm.weight", "model.layers.2.self_attn.k_norm.weight"),
    "bloom": ("transformer.h.1.mlp.dense_h_to_4h.bias", "transformer.h.1.dense_h_to_4h.bias"),
}
# variant -> a config.json change the checkpoint's shapes disagree with, and the parameter the
# error names (ChatGLM: by our GLM names, which its checkpoint names are mapped onto)
SHAPE = {
    "opt": (dict(ffn_dim=96), "model.decoder.layers.0.fc1.bias"),
    "phi3-longrope": (dict(intermediate_size=96), "model.layers.0.mlp.down_proj.weight"),
    "glm": (dict(intermediate_size=96), "model.layers.0.mlp.down_proj.weight"),
    "glm4": (dict(intermediate_size=96), "model.layers.0.mlp.down_proj.weight"),
    "chatglm": (dict(ffn_hidden_size=96), "model.layers.0.mlp.down_proj.weight"),
    "gemma2": (dict(intermediate_size=96), "model.layers.0.mlp.down_proj.weight"),
    "gemma3": (dict(head_dim=8), "model.layers.0.self_attn.k_norm.weight"),
    "bloom": (dict(n_head=8, hidden_size=48), "transformer.h.0.input_layernorm.bias"),
}


@pytest.mark.parametrize("variant", list(ACTIVATION))
def test_unknown_activation(family_dir, tmp_path, variant):
    field = ACTIVATION[variant]
    bad = _copy(family_dir(variant), tmp_path / "m", **{field: "softplus_x"})
    assert f"'softplus_x' ({field} in config.json)" in _one_line_error(bad)


@pytest.mark.parametrize("variant", list(ROPE))
def test_unknown_rope_type(family_dir, tmp_path, variant):
    bad = _copy(family_dir(variant), tmp_path / "m", **ROPE[variant])
    message = _one_line_error(bad)
    # Phi-3: transformers' own config validation refuses it first (made one line)
    assert "unsupported rope type 'mrope_x'" in message or (
        variant == "phi3-longrope" and "type field must be one of ['longrope'], got mrope_x"
        in message), message


@pytest.mark.parametrize("variant", list(MISSING))
def test_missing_tensor(family_dir, tmp_path, variant):
    dropped, named = MISSING[variant]
    bad = _copy(family_dir(variant), tmp_path / "m")
    _drop_tensor(bad, dropped)
    message = _one_line_error(bad)
    assert "missing" in message and named in message, message


@pytest.mark.parametrize("variant", list(SHAPE))
def test_shape_mismatch_against_config(family_dir, tmp_path, variant):
    change, named = SHAPE[variant]
    bad = _copy(family_dir(variant), tmp_path / "m", **change)
    message = _one_line_error(bad)
    assert f"parameter {named!r}" in message and "config.json" in message, message
