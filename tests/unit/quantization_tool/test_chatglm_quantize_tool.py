"""blade_llm_quantize on a ChatGLM2/3 checkpoint (``ChatGLMModel`` layout): quantized as the
transformers GlmForCausalLM of the same weights and written as a GLM checkpoint, which must be
the checkpoint of the same GLM weights quantized directly, and serve its tokens and logits."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from bladellm.entrypoints.cli.quantize import run
from bladellm.quantization.algorithms.model_source import (glm_config_of_chatglm,
                                                           glm_state_of_chatglm)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
from family_models import make_family_model, write_chatglm  # noqa: E402

ALGOS = {"gptq": ["--group_size", "32"], "awq": ["--group_size", "32"],
         "minmax": ["--group_size", "32"], "smoothquant": ["--bit", "8", "--group_size", "-1"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A GLM (rope_theta 50000: ChatGLM's rope_ratio 5) and the same weights as ChatGLM."""
    glm = make_family_model(tmp_path_factory.mktemp("glm"), "glm", rope_theta=50000.0)
    return glm, write_chatglm(glm, tmp_path_factory.mktemp("chatglm"))


def _quantize(src: str, out, algo: str, calib: str | None, *extra: str) -> str:
    calib_flags = [] if algo == "minmax" else [
        "--calib_data", calib, "--num_calib_samples", "4", "--calib_data_max_len", "32"]
    run(["--model", src, "--output_dir", str(out), "--quant_algo", algo, *calib_flags,
         *ALGOS[algo], *extra])
    return str(out)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(f))
    return out


def test_mapping_gives_back_the_glm_weights_and_config(dirs):
    """The library's ChatGLM -> GLM mapping (the one the engine loads ChatGLM with) inverts
    the tests' GLM -> ChatGLM writer exactly."""
    glm, chatglm = dirs
    raw = json.loads(open(os.path.join(chatglm, "config.json")).read())
    state = glm_state_of_chatglm(raw, load_file(os.path.join(chatglm, "model.safetensors")))
    want = load_file(os.path.join(glm, "model.safetensors"))
    assert sorted(state) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    ours, theirs = glm_config_of_chatglm(raw), json.loads(open(os.path.join(
        glm, "config.json")).read())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "attention_bias", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, key) == theirs[key], key
    assert ours.rope_parameters["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    assert ours.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.architectures == ["GlmForCausalLM"]


@pytest.mark.parametrize("algo", list(ALGOS))
def test_chatglm_quantizes_to_the_glm_checkpoint(dirs, tmp_path, calib_file, algo, caplog):
    glm, chatglm = dirs
    want = _quantize(glm, tmp_path / "glm", algo, calib_file)
    with caplog.at_level(logging.INFO, logger="bladellm.quantize"):
        got = _quantize(chatglm, tmp_path / "chatglm", algo, calib_file)
    assert "will be a GLM checkpoint (GlmForCausalLM) of the same model" in caplog.text
    a, b = _tensors(want), _tensors(got)
    assert sorted(a) == sorted(b)
    assert any(n.endswith("self_attn.k_proj.qweight" if algo != "smoothquant" else
                          "self_attn.k_proj.weight_scale") for n in b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    config = json.loads(open(os.path.join(got, "config.json")).read())
    assert config["architectures"] == ["GlmForCausalLM"] and config["model_type"] == "glm"
    assert "auto_map" not in config and "num_layers" not in config
    assert config["quantization_config"] == json.loads(open(os.path.join(
        want, "config.json")).read())["quantization_config"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(got, name)), name


@pytest.mark.parametrize("algo", ["gptq", "smoothquant"])
def test_quantized_chatglm_serves_the_quantized_glm(dirs, tmp_path, calib_file, algo):
    from bladellm import LLM, SamplingParams

    glm, chatglm = dirs
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [40, 41]]
    outs = []
    for name, src in (("glm", glm), ("chatglm", chatglm)):
        llm = LLM(model=_quantize(src, tmp_path / name, algo, calib_file), dtype="float32",
                  max_model_len=64, num_kv_blocks=32, block_size=4)
        try:
            res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                       logprobs=5), use_tqdm=False)
        finally:
            llm.shutdown()
        outs.append([(o.outputs[0].token_ids,
                      [[(e.token_id, e.logprob) for e in step] for step in o.outputs[0].logprobs])
                     for o in res])
    assert outs[0] == outs[1]
    assert len({tuple(tokens) for tokens, _ in outs[0]}) == len(prompts)  # not degenerate


def test_chatglm_refusals_name_the_flag_or_field(dirs, tmp_path, calib_file):
    glm, chatglm = dirs
    with pytest.raises(ValueError, match="^--cpu_offload: not supported for ChatGLM"):
        _quantize(chatglm, tmp_path / "a", "gptq", calib_file, "--cpu_offload")
    variant = tmp_path / "layernorm"
    variant.mkdir()
    for name in os.listdir(chatglm):
        (variant / name).write_bytes(open(os.path.join(chatglm, name), "rb").read())
    raw = json.loads((variant / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**raw, "rmsnorm": False}))
    with pytest.raises(ValueError, match=r"^--model: ChatGLM config rmsnorm=False"):
        _quantize(str(variant), tmp_path / "b", "minmax", None)
    # a layer's tensor missing: named under the checkpoint's fused name's GLM parts
    (variant / "config.json").write_text(json.dumps(raw))
    state = load_file(str(variant / "model.safetensors"))
    del state["transformer.encoder.layers.1.self_attention.query_key_value.weight"]
    save_file(state, str(variant / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 3 tensor\(s\).*layers\.1\.self_attn\.q_proj"):
        _quantize(str(variant), tmp_path / "d", "minmax", None)
    shutil.copy(os.path.join(chatglm, "model.safetensors"), variant / "model.safetensors")
    # a tokenizer that is only the directory's code cannot tokenize --calib_data
    os.remove(variant / "tokenizer.json")
    tok = json.loads((variant / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}
    (variant / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"^--quant_algo gptq: the tokenizer .* --quant_algo "
                                         r"minmax"):
        _quantize(str(variant), tmp_path / "c", "gptq", calib_file)
    assert not os.path.exists(tmp_path / "c")
