"""Unsupported quantization configs, tensors and TP layouts are refused with a ValueError naming
the field or flag; --quantization must agree with the checkpoint."""

from __future__ import annotations

import copy
import os
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from bladellm.attention import get_attn_backend
from bladellm.config import ModelConfig
from bladellm.kernels import resolve_kernels
from bladellm.kernels.scope import building_with
from bladellm.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.model.loader import load_model
from bladellm.quantization import get_quant_config
from bladellm.quantization.base import checkpoint_module_names
from quant_checkpoints import awq_config, ct_config, gptq_config, quantize_checkpoint, \
    set_config_field


def _cfg(raw: dict | None):
    return types.SimpleNamespace(quantization_config=raw)


GPTQ = gptq_config(4, 32, False, False)
AWQ = awq_config(32)
CT = ct_config("pack-quantized", 4, 32, True, False)
CT_W8A8 = ct_config("int-quantized", 8, -1, True, True)


def _with(raw: dict, path: str, value) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    return raw


BAD = [
    (_with(GPTQ, "quant_method", "bitsandbytes"), "quant_method"),
    (_with(GPTQ, "bits", 3), "bits"),
    (_with(GPTQ, "bits", 2), "bits"),
    (_with(GPTQ, "group_size", 0), "group_size"),
    (_with(GPTQ, "checkpoint_format", "gptq_v2"), "checkpoint_format"),
    (_with(GPTQ, "lm_head", True), "lm_head"),
    (_with(GPTQ, "dynamic", {"+:.*down.*": {"bits": 8}}), "dynamic"),
    (_with(GPTQ, "dynamic", {".*down.*": {"bits": 8}}), "dynamic"),
    (_with(GPTQ, "dynamic", {"-:(": {}}), "dynamic"),
    (_with(AWQ, "bits", 8), "w_bit"),
    (_with(AWQ, "version", "gemv"), "version"),
    (_with(AWQ, "zero_point", False), "zero_point"),
    (_with(CT, "format", "float-quantized"), "format"),
    (_with(CT, "quantization_status", "frozen"), "quantization_status"),
    (_with(CT, "config_groups.group_0.weights.num_bits", 3), "num_bits"),
    (_with(CT, "config_groups.group_0.weights.type", "float"), "type"),
    (_with(CT, "config_groups.group_0.weights.actorder", "group"), "actorder"),
    (_with(CT, "config_groups.group_0.weights.strategy", "block"), "strategy"),
    (_with(CT, "config_groups.group_0.input_activations",
           CT_W8A8["config_groups"]["group_0"]["input_activations"]), "input_activations"),
    (_with(CT_W8A8, "config_groups.group_0.input_activations.dynamic", False), "dynamic"),
    (_with(CT_W8A8, "config_groups.group_0.input_activations.strategy", "tensor"),
     "strategy"),
    (_with(CT_W8A8, "config_groups.group_0.input_activations.symmetric", False), "symmetric"),
    (_with(CT, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
    (_with(CT, "config_groups", {}), "config_groups"),
]


@pytest.mark.parametrize("raw,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_unsupported_config_is_a_value_error_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        get_quant_config(_cfg(raw))


def test_supported_configs_are_accepted():
    assert get_quant_config(_cfg(GPTQ)).name == "gptq"
    assert get_quant_config(_cfg(AWQ)).name == "awq"
    assert get_quant_config(_cfg(CT)).name == "compressed-tensors"
    assert get_quant_config(_cfg(CT_W8A8), "compressed-tensors").name == "compressed-tensors"
    assert get_quant_config(_cfg(None)) is None


def test_quantization_flag_must_agree_with_the_checkpoint():
    with pytest.raises(ValueError, match="--quantization awq.*gptq"):
        get_quant_config(_cfg(GPTQ), "awq")
    with pytest.raises(ValueError, match="--quantization gptq.*not quantized"):
        get_quant_config(_cfg(None), "gptq")
    with pytest.raises(ValueError, match="--quantization"):
        ModelConfig(quantization="int4")


def test_ignore_and_modules_to_not_convert_keep_layers_in_float():
    ct = get_quant_config(_cfg(_with(CT, "ignore", ["lm_head", "re:.*mlp.down_proj$"])))
    layer = types.SimpleNamespace()
    assert ct.scheme_for(layer, ["model.layers.0.mlp.down_proj"]) is None
    assert ct.scheme_for(layer, ["model.layers.0.mlp.gate_proj",
                                 "model.layers.0.mlp.up_proj"]) is not None
    partly = get_quant_config(_cfg(_with(CT, "ignore", ["model.layers.0.self_attn.k_proj"])))
    with pytest.raises(ValueError, match="fused"):
        partly.scheme_for(layer, [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
    awq = get_quant_config(_cfg(_with(AWQ, "modules_to_not_convert", ["mlp"])))
    assert awq.scheme_for(layer, ["model.layers.0.mlp.down_proj"]) is None
    # GPTQModel's dynamic "-:" exclusions (re.match on the module name)
    gptq = get_quant_config(_cfg(_with(GPTQ, "dynamic", {r"-:.*\.shared_expert\.": {}})))
    assert gptq.scheme_for(layer, ["model.layers.1.mlp.shared_expert.down_proj"]) is None
    assert gptq.scheme_for(layer, ["model.layers.1.mlp.experts.0.down_proj"]) is not None
    with pytest.raises(ValueError, match="dynamic.*only some"):
        get_quant_config(_cfg(_with(GPTQ, "dynamic", {"-:.*k_proj": {}}))).scheme_for(
            layer, [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])


def test_fused_names_come_from_the_model():
    """A fused layer's checkpoint modules are the model's ``packed_modules_mapping`` (handed in
    by ``for_model``), not Llama's: a family that fuses other names gets its own."""
    llama = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    other = {"wqkv": ["wq", "wk", "wv"]}
    prefix = "model.layers.0.self_attn"
    assert checkpoint_module_names(f"{prefix}.qkv_proj", llama) == \
        [f"{prefix}.{p}_proj" for p in "qkv"]
    assert checkpoint_module_names(f"{prefix}.wqkv", other) == [f"{prefix}.w{p}" for p in "qkv"]
    assert checkpoint_module_names(f"{prefix}.qkv_proj", other) == [f"{prefix}.qkv_proj"]
    partly = get_quant_config(_cfg(_with(CT, "ignore", [f"{prefix}.wk"])))
    assert partly.packed_modules_mapping == {}  # nothing fused until a model hands its names
    layer = types.SimpleNamespace()
    assert partly.get_quant_method(layer, f"{prefix}.wqkv") is not None
    with pytest.raises(ValueError, match="fused"):
        partly.for_model(other).get_quant_method(layer, f"{prefix}.wqkv")
    assert partly.packed_modules_mapping == {}  # for_model leaves the shared config alone


@pytest.mark.usefixtures("layer_kernels")
def test_tp_shards_off_group_boundaries_are_refused():
    gptq = get_quant_config(_cfg(GPTQ))  # group 32
    with pytest.raises(ValueError, match="--tensor_parallel_size.*boundaries"):
        RowParallelLinear(128, 64, bias=False, params_dtype=torch.float32, quant_config=gptq,
                          prefix="l.down_proj", input_partition=(48, 48))
    RowParallelLinear(128, 64, bias=False, params_dtype=torch.float32, quant_config=gptq,
                      prefix="l.down_proj", input_partition=(64, 64))
    awq = get_quant_config(_cfg(AWQ))  # eight outputs per packed word
    with pytest.raises(ValueError, match="--tensor_parallel_size.*output features"):
        ColumnParallelLinear(64, 48, bias=False, params_dtype=torch.float32, quant_config=awq,
                             prefix="l.up_proj", output_shards=[(20, 12)])
    act_order = get_quant_config(_cfg(_with(GPTQ, "desc_act", True)))
    with pytest.raises(ValueError, match="--tensor_parallel_size.*desc_act"):
        RowParallelLinear(128, 64, bias=False, params_dtype=torch.float32,
                          quant_config=act_order, prefix="l.down_proj",
                          input_partition=(64, 64))
    # act-order layers split along their outputs are fine
    ColumnParallelLinear(64, 48, bias=False, params_dtype=torch.float32,
                         quant_config=act_order, prefix="l.up_proj", output_shards=[(16, 16)])


def _load(model_dir: str, **kwargs):
    cfg = load_hf_config(model_dir, False)
    kernels = resolve_kernels("auto", "cpu")  # what a CPU worker hands its model by default
    with building_with(kernels):
        return load_model(ModelConfig(model=model_dir, **kwargs), cfg, torch.float32, "cpu",
                          get_attn_backend(None, kernels))


def test_missing_or_wrong_tensors_are_refused(tiny_llama, tmp_path):
    model_dir = str(tmp_path / "gptq")
    quantize_checkpoint(tiny_llama, model_dir, "gptq", bits=4, group_size=32)
    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    broken = {k: v for k, v in state.items() if k != "model.layers.1.mlp.down_proj.qzeros"}
    save_file(broken, path)
    with pytest.raises(ValueError, match="missing.*down_proj.qzeros"):
        _load(model_dir)
    broken = dict(state)
    broken["model.layers.1.mlp.down_proj.qweight"] = state[
        "model.layers.1.mlp.down_proj.qweight"].float()
    save_file(broken, path)
    with pytest.raises(ValueError, match="qweight.*dtype"):
        _load(model_dir)
    save_file(state, path)
    set_config_field(model_dir, bits=8)  # the tensors are 4-bit: shapes disagree
    with pytest.raises(ValueError, match="qweight"):
        _load(model_dir)
    set_config_field(model_dir, bits=4)
    with pytest.raises(ValueError, match="load_format dummy"):
        _load(model_dir, load_format="dummy")
    assert _load(model_dir) is not None

