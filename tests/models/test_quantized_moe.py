"""Quantized mixture-of-experts checkpoints (per-expert packed tensors as AutoGPTQ / GPTQModel /
AutoAWQ / llm-compressor write them, packed by the independent test-side packers of
tests/quant_checkpoints.py) against transformers running the same model with the dequantized
weights in fp32: logits through a paged KV cache; the experts stay packed in memory; the layer
equals its plain-PyTorch twin (``kernels.ref.fused_moe`` on the dequantized experts), expert
parallel ids included; partial exclusions are refused by name; greedy tokens through the engine
under the stress configuration."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bladellm.attention import get_attn_backend
from bladellm.checkpoint.hf_config import load_hf_config
from bladellm.config import ModelConfig
from bladellm.kernels import ref
from bladellm.model.layers.fused_moe import FusedMoE, moe_layers
from bladellm.model.loader import load_model
from bladellm.quantization.gptq import GPTQConfig
from quant_checkpoints import (MOE_SHAPES as SHAPES, dequantized_checkpoint, minmax_quantize,
                               pack_gptq, quantize_checkpoint, set_config_field)
from test_parity import check_prefill_then_decode

CASES = {
    "mixtral-gptq-4bit-g32": ("mixtral", dict(fmt="gptq", bits=4, group_size=32, sym=False)),
    "qwen2_moe-awq-g32": ("qwen2_moe", dict(fmt="awq", group_size=32)),
    "qwen2_moe-gptq-4bit-desc_act": ("qwen2_moe", dict(fmt="gptq", bits=4, group_size=32,
                                                        sym=True, desc_act=True)),
    "qwen3_moe-gptq-8bit-channel": ("qwen3_moe", dict(fmt="gptq", bits=8, group_size=-1,
                                                      sym=True)),
    "qwen3_moe-ct-w4a16-g32": ("qwen3_moe", dict(fmt="ct-pack", bits=4, group_size=32,
                                                 sym=True)),
}


def _load(model_dir: str, kernels):
    return load_model(ModelConfig(model=model_dir), load_hf_config(model_dir, False),
                      torch.float32, "cpu", get_attn_backend(None, kernels))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_the_dequantized_model(tiny_model_factory, tmp_path, case, layer_kernels):
    arch, quant = CASES[case]
    src = tiny_model_factory(arch, **SHAPES[arch])
    fake = quantize_checkpoint(src, tmp_path / "q", **quant)
    assert any(".experts.0." in name for name in fake)
    ours = _load(str(tmp_path / "q"), layer_kernels)
    ref_dir = dequantized_checkpoint(src, fake, tmp_path / "ref")
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    check_prefill_then_decode(ours, reference.eval())
    # The experts stay packed: no stacked float experts, and each expert's codes are integers.
    layers = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    assert layers and moe_layers(ours) == []
    for layer in layers:
        assert not hasattr(layer, "gate_up_proj") and not hasattr(layer, "down_proj")
        codes = [b for name, b in layer.named_buffers() if name.endswith("_q_codes")]
        assert len(codes) == 2 * layer.num_local_experts
        assert all(not c.dtype.is_floating_point for c in codes)


def test_gptq_dynamic_exclusions_keep_the_shared_expert_float(tiny_model_factory, tmp_path,
                                                              layer_kernels):
    """GPTQModel's ``dynamic`` "-:" keys: the shared expert excluded stays float."""
    src = tiny_model_factory("qwen2_moe", **SHAPES["qwen2_moe"])
    skip = r".*\.shared_expert\."
    fake = quantize_checkpoint(src, tmp_path / "q", fmt="gptq", bits=4, group_size=32,
                               skip=skip)
    set_config_field(tmp_path / "q", dynamic={f"-:{skip}": {}})
    assert not any("shared_expert" in name for name in fake)
    ours = _load(str(tmp_path / "q"), layer_kernels)
    shared = ours.model.layers[1].mlp.shared_expert
    assert shared.gate_up_proj.weight.dtype == torch.float32
    ref_dir = dequantized_checkpoint(src, fake, tmp_path / "ref")
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    check_prefill_then_decode(ours, reference.eval())


def test_experts_all_excluded_load_float(tiny_model_factory, tmp_path, layer_kernels):
    """AWQ ``modules_to_not_convert`` naming every expert: the experts load stacked in float
    (and are prepacked as float experts), the attention stays quantized."""
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    fake = quantize_checkpoint(src, tmp_path / "q", fmt="awq", group_size=32,
                               skip=r".*\.experts\.")
    set_config_field(tmp_path / "q", modules_to_not_convert=["experts"])
    ours = _load(str(tmp_path / "q"), layer_kernels)
    layers = moe_layers(ours)
    assert len(layers) == 2 and all(m.quant_method is None for m in layers)
    assert layers[0].gate_up_proj.dtype == torch.float32
    ref_dir = dequantized_checkpoint(src, fake, tmp_path / "ref")
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    check_prefill_then_decode(ours, reference.eval())


@torch.no_grad()
def test_a_decode_step_runs_only_the_selected_experts(tiny_model_factory, tmp_path,
                                                      layer_kernels):
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])  # 8 experts, top 3
    quantize_checkpoint(src, tmp_path, fmt="gptq", bits=4, group_size=32)
    ours = _load(str(tmp_path), layer_kernels)
    layer = ours.model.layers[0].mlp.experts
    calls = []
    for e, pair in enumerate(layer.quant_experts):
        for which, proj in pair.items():
            proj.register_forward_hook(lambda *_a, e=e, w=which: calls.append((e, w)))
    x = torch.randn(1, layer.hidden_size)
    layer(x, torch.randn(1, layer.num_experts))
    assert len(calls) == 2 * layer.top_k and len({e for e, _ in calls}) == layer.top_k


def _gptq_expert_tensors(w13: torch.Tensor, w2: torch.Tensor, bits: int = 4, group: int = 16):
    """Per-expert GPTQ tensors of stacked float experts, and the dequantized stacks."""
    tensors, deq13, deq2 = {}, [], []
    I = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        parts = {"gate_proj": w13[e, :I], "up_proj": w13[e, I:], "down_proj": w2[e]}
        for part, w in parts.items():
            qz = minmax_quantize(w, bits, group, sym=False, signed=False)
            tensors.update({(e, part, k): v for k, v in pack_gptq(qz, bits).items()})
            parts[part] = qz.dequantized()
        deq13.append(torch.cat([parts["gate_proj"], parts["up_proj"]]))
        deq2.append(parts["down_proj"])
    return tensors, torch.stack(deq13), torch.stack(deq2)


@torch.no_grad()
def test_layer_equals_its_twin_on_the_dequantized_experts(layer_kernels):
    E, H, I, k, T = 5, 32, 48, 2, 11
    gen = torch.Generator().manual_seed(0)
    tensors, w13, w2 = _gptq_expert_tensors(torch.randn(E, 2 * I, H, generator=gen),
                                            torch.randn(E, H, I, generator=gen))
    config = GPTQConfig(bits=4, group_size=16, desc_act=False, sym=False)
    layer = FusedMoE(E, k, H, I, renormalize=True, params_dtype=torch.float32,
                     quant_config=config, prefix="model.layers.0.mlp.experts")
    from bladellm.model.layers.fused_moe import EXPERT_PARTS

    for (e, part, name), t in tensors.items():
        which, index = EXPERT_PARTS[part]
        assert layer.load_expert(which, e, index, t, name)
    assert len(layer.loaded_names()) == len(list(layer.parameters()))
    from bladellm.quantization import process_quantized_layers

    assert process_quantized_layers(layer) == 2 * E
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    torch.testing.assert_close(layer(x, logits),
                               ref.fused_moe(x, w13, w2, *ref.moe_route(logits, k, True)),
                               atol=1e-4, rtol=1e-4)
    # Expert parallelism hands the layer ids outside its experts: they contribute nothing.
    weights, ids = ref.moe_route(logits, k, True)
    ids = torch.where(ids == 3, torch.full_like(ids, -1), ids)
    got = layer._experts(x, weights, ids)
    torch.testing.assert_close(got, ref.fused_moe(x, w13, w2, weights, ids), atol=1e-4,
                               rtol=1e-4)
    assert layer._experts(x[:0], weights[:0], ids[:0]).shape == (0, H)


def test_some_experts_excluded_is_refused_by_name(tiny_model_factory, tmp_path, layer_kernels):
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    quantize_checkpoint(src, tmp_path, fmt="awq", group_size=32)
    set_config_field(tmp_path, modules_to_not_convert=["experts.1."])
    with pytest.raises(ValueError, match="modules_to_not_convert.*all quantized or all float"):
        _load(str(tmp_path), layer_kernels)


def test_unpacked_experts_report_missing_tensors(tiny_model_factory, tmp_path, layer_kernels):
    src = tiny_model_factory("qwen3_moe", **SHAPES["qwen3_moe"])
    quantize_checkpoint(src, tmp_path, fmt="gptq", bits=4, group_size=32)
    state = load_file(str(tmp_path / "model.safetensors"))
    gone = "model.layers.1.mlp.experts.2.up_proj.scales"
    del state[gone]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing.*experts\.quant_experts\.2\.gate_up_proj"
                                         r"\.scales"):
        _load(str(tmp_path), layer_kernels)


@torch.no_grad()
def test_w8a8_experts_equal_their_twin(layer_kernels):
    """compressed-tensors W8A8 experts (int8 weights, per-token int8 activations): each
    selected expert's projections equal ``w8a8_reference`` (exact integer sums)."""
    from bladellm.quantization.compressed_tensors import CompressedTensorsConfig
    from bladellm.quantization.cpu_kernels import w8a8_reference
    from bladellm.quantization.int_weight import IntWeight, default_g_idx
    from bladellm.quantization.moe_method import quantized_fused_moe
    from quant_checkpoints import ct_config, pack_ct_int8

    E, H, I, k, T = 4, 32, 48, 2, 7
    gen = torch.Generator().manual_seed(1)
    config = CompressedTensorsConfig.from_config(ct_config("int-quantized", 8, -1, True, True))
    layer = FusedMoE(E, k, H, I, renormalize=False, params_dtype=torch.float32,
                     quant_config=config, prefix="model.layers.0.mlp.experts")
    from bladellm.model.layers.fused_moe import EXPERT_PARTS
    from bladellm.quantization import process_quantized_layers

    twins = []
    for e in range(E):
        ints = {}
        for part, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            qz = minmax_quantize(torch.randn(*shape, generator=gen), 8, -1, sym=True,
                                 signed=True, scale_dtype=torch.float32)
            which, index = EXPERT_PARTS[part]
            for name, t in pack_ct_int8(qz).items():
                layer.load_expert(which, e, index, t, name)
            ints[part] = qz
        gate_up = IntWeight(torch.cat([ints["gate_proj"].q, ints["up_proj"].q]).to(torch.int16),
                            torch.cat([ints["gate_proj"].scales, ints["up_proj"].scales]),
                            None, default_g_idx(H, H), 8)
        down = IntWeight(ints["down_proj"].q.to(torch.int16), ints["down_proj"].scales, None,
                         default_g_idx(I, I), 8)
        twins.append((lambda x, w=gate_up: w8a8_reference(x, w, None),
                      lambda x, w=down: w8a8_reference(x, w, None)))
    assert process_quantized_layers(layer) == 2 * E
    x = torch.randn(T, H, generator=gen)
    weights, ids = ref.moe_route(torch.randn(T, E, generator=gen), k, False)
    want = quantized_fused_moe(x, twins, weights, ids, ref.silu_and_mul, H)
    torch.testing.assert_close(layer._experts(x, weights, ids), want, atol=1e-4, rtol=1e-4)
