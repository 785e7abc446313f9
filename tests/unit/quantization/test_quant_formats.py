"""Each checkpoint format, packed in the test exactly as its producer writes it, unpacks to the
same integers, zero points and scales: the loader's dequantized weights equal the test's own
min-max fake-quantized weights bit for bit (fused q/k/v and gate/up included)."""

from __future__ import annotations

import pytest
import torch

from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.model.loader import build_model, find_weight_files, load_checkpoint_files
from bladellm.quantization import get_quant_config, process_quantized_layers
from bladellm.quantization.int_weight import dequantize
from bladellm.quantization.method import QuantLinearMethod
from quant_checkpoints import quantize_checkpoint

# name -> quantize_checkpoint kwargs
VARIANTS = {
    "gptq-4bit-g32-asym": dict(fmt="gptq", bits=4, group_size=32, sym=False),
    "gptq-4bit-channel-sym": dict(fmt="gptq", bits=4, group_size=-1, sym=True),
    "gptq-8bit-g32-asym": dict(fmt="gptq", bits=8, group_size=32, sym=False),
    "gptq-4bit-g32-desc_act": dict(fmt="gptq", bits=4, group_size=32, sym=True, desc_act=True),
    "awq-g32": dict(fmt="awq", group_size=32),
    "ct-w4a16-g32-sym": dict(fmt="ct-pack", bits=4, group_size=32, sym=True),
    "ct-w4a16-g32-asym": dict(fmt="ct-pack", bits=4, group_size=32, sym=False),
    "ct-w8a16-channel": dict(fmt="ct-pack", bits=8, group_size=-1, sym=True),
    "ct-w8a8": dict(fmt="ct-w8a8"),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _expected(prefix: str, fake: dict[str, torch.Tensor]) -> torch.Tensor:
    parent, _, leaf = prefix.rpartition(".")
    parts = FUSED.get(leaf, (leaf,))
    return torch.cat([fake[f"{parent}.{p}.weight"] for p in parts])


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            d = tmp_path_factory.mktemp(name)
            cache[name] = (str(d), quantize_checkpoint(tiny_llama, d, **VARIANTS[name]))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dequantized_weights_equal_the_reference_exactly(checkpoints, name, layer_kernels):
    model_dir, fake = checkpoints(name)
    hf_config = load_hf_config(model_dir, False)
    quant = get_quant_config(hf_config)
    assert quant is not None and quant.name == VARIANTS[name]["fmt"].replace(
        "ct-pack", "compressed-tensors").replace("ct-w8a8", "compressed-tensors")
    model = build_model(hf_config, torch.float32, "cpu", get_attn_backend(None, layer_kernels),
                        quant_config=quant)
    load_checkpoint_files(model, find_weight_files(model_dir))
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                       QuantLinearMethod)]
    assert len(layers) == 4 * hf_config.num_hidden_layers
    for layer in layers:
        params = {n: getattr(layer, n).data for n in layer.quant_param_names}
        got = dequantize(layer.quant_method.scheme.to_int_weight(params))
        want = _expected(layer.prefix, fake)
        assert torch.equal(got, want), layer.prefix
    # The kernels' layouts hold the same weight: their output matches F.linear on it.
    assert process_quantized_layers(model) == len(layers)
    x = torch.randn(5, hf_config.hidden_size)
    layer = model.model.layers[0].self_attn.qkv_proj
    want = x @ _expected(layer.prefix, fake).t()
    got = layer(x)
    if VARIANTS[name]["fmt"] == "ct-w8a8":  # activations quantized per token: not exact
        assert (got - want).norm() / want.norm() < 0.05
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not any(hasattr(layer, n) for n in layer.quant_param_names)


def test_quantized_checkpoint_is_smaller_in_memory(checkpoints, layer_kernels):
    from bladellm.platforms.cpu_defaults import model_weight_bytes

    model_dir, _ = checkpoints("awq-g32")
    hf_config = load_hf_config(model_dir, False)
    quant = get_quant_config(hf_config)
    model = build_model(hf_config, torch.float32, "cpu", get_attn_backend(None, layer_kernels),
                        quant_config=quant)
    load_checkpoint_files(model, find_weight_files(model_dir))
    process_quantized_layers(model)
    layer = model.model.layers[0].mlp.down_proj
    fp32 = layer.input_size * layer.output_size * 4
    buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert 0 < buffers < fp32 / 2  # 4-bit codes (+ ATen's int4 copy) and group scales
    assert model_weight_bytes(layer) == buffers


def test_w8a8_packed_weights_are_counted(checkpoints, layer_kernels):
    """fbgemm's packed int8 weight is an opaque object, not a tensor: the memory accounting
    (``model_weight_bytes``, which sizes the auto KV pool) must still count its int8 codes."""
    from bladellm.platforms.cpu_defaults import model_weight_bytes
    from bladellm.quantization.cpu_kernels import Int8DynamicLinear

    model_dir, _ = checkpoints("ct-w8a8")
    hf_config = load_hf_config(model_dir, False)
    model = build_model(hf_config, torch.float32, "cpu", get_attn_backend(None, layer_kernels),
                        quant_config=get_quant_config(hf_config))
    load_checkpoint_files(model, find_weight_files(model_dir))
    process_quantized_layers(model)
    layer = model.model.layers[0].mlp.down_proj
    if not isinstance(layer.quant_kernel, Int8DynamicLinear):
        pytest.skip("no fbgemm here: the reference kernel keeps plain tensors")
    codes = layer.input_size * layer.output_size  # int8
    assert codes < model_weight_bytes(layer) < 2 * codes
