"""Bad checkpoints are one-line errors naming the problem: an unknown activation or rope type,
a missing tensor, a shape that disagrees with config.json, an unsupported ChatGLM variant; and
at the CLI, that line without a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from family_models import family_dirs
from test_family_parity import load_ours


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return family_dirs(tmp_path_factory)


def _copy(src: str, dst: Path, **config_changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _drop_tensor(model_dir: str, name: str) -> None:
    path = str(Path(model_dir) / "model.safetensors")
    state = load_file(path)
    del state[name]
    save_file(state, path, metadata={"format": "pt"})


def _one_line_error(model_dir: str) -> str:
    with pytest.raises(ValueError) as info:
        load_ours(model_dir)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_activation(tiny_model_factory, tmp_path):
    bad = _copy(tiny_model_factory("llama"), tmp_path / "m", hidden_act="swiglu_x")
    assert "unsupported activation 'swiglu_x' (hidden_act in config.json)" in \
        _one_line_error(bad)


def test_unknown_opt_activation(family_dir, tmp_path):
    bad = _copy(family_dir("opt"), tmp_path / "m", activation_function="softplus")
    assert "'softplus' (activation_function in config.json)" in _one_line_error(bad)


def test_unknown_rope_type(tiny_model_factory, tmp_path):
    bad = _copy(tiny_model_factory("llama"), tmp_path / "m", rope_parameters=None,
                rope_scaling={"rope_type": "mrope_x", "factor": 2.0})
    assert "unsupported rope type 'mrope_x'" in _one_line_error(bad)


def test_missing_tensor_named_by_its_checkpoint_name(tiny_model_factory, tmp_path):
    bad = _copy(tiny_model_factory("llama"), tmp_path / "m")
    _drop_tensor(bad, "model.layers.1.self_attn.k_proj.weight")
    message = _one_line_error(bad)
    assert "model.layers.1.self_attn.qkv_proj.weight (checkpoint: no " \
        "model.layers.1.self_attn.k_proj.weight)" in message


def test_missing_unfused_tensor(family_dir, tmp_path):
    bad = _copy(family_dir("opt"), tmp_path / "m")
    _drop_tensor(bad, "model.decoder.layers.0.fc2.weight")
    assert "missing 1 parameter(s): model.decoder.layers.0.fc2.weight" in _one_line_error(bad)


def test_shape_mismatch_against_config(tiny_model_factory, tmp_path):
    bad = _copy(tiny_model_factory("llama"), tmp_path / "m", intermediate_size=96)
    message = _one_line_error(bad)
    assert "model.layers.0.mlp" in message and "config.json" in message


def test_fused_tensor_rows_against_config(family_dir, tmp_path):
    """Phi-3's fused qkv_proj split by config.json's head counts: a disagreement names it."""
    bad = _copy(family_dir("phi3-longrope"), tmp_path / "m", num_key_value_heads=1)
    message = _one_line_error(bad)
    assert "'model.layers.0.self_attn.qkv_proj.weight'" in message
    assert "config.json gives" in message


@pytest.mark.parametrize("change, message", [
    ({"rmsnorm": False}, "ChatGLM config rmsnorm=False"),
    ({"quantization_bit": 4}, "ChatGLM config quantization_bit=4"),
    ({"pre_seq_len": 128}, "ChatGLM config pre_seq_len=128")])
def test_unsupported_chatglm_variant(family_dir, tmp_path, change, message):
    bad = _copy(family_dir("chatglm"), tmp_path / "m", **change)
    assert message in _one_line_error(bad)


@pytest.mark.slow
def test_server_cli_prints_one_line_no_traceback(tiny_model_factory, tmp_path):
    bad = _copy(tiny_model_factory("llama"), tmp_path / "m", hidden_act="swiglu_x")
    proc = subprocess.run([sys.executable, "-m", "bladellm.entrypoints.cli.server", "--model",
                           bad, "--port", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert "unsupported activation 'swiglu_x' (hidden_act in config.json)" in out
