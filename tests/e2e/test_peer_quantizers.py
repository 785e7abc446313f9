"""Checkpoints written by the quantizers people use (llm-compressor, GPTQModel) from a tiny
random Llama made here, read by BladeLLM's loaders (docs/quantization.md):

* the weights our loader dequantizes equal the peer's own dequantization exactly
  (compressed-tensors' decompression as transformers runs it; GPTQModel's ``TorchLinear``);
* the offline ``LLM`` decodes greedily what transformers decodes with the peer's dequantized
  weights (weight-only formats; W8A8 quantizes activations, checked through the weights).

Slow (each peer calibrates, and imports take ~10 s) and skipped where the peer is not installed:
both live in a venv beside the system torch (benchmarks/peers/install_quant_peers.sh):

    /tmp/qpeers/bin/python -m pytest -m slow tests/e2e/test_peer_quantizers.py
"""

from __future__ import annotations

import os

import pytest
import torch

from test_quantized_serving import MAX_TOKENS, PROMPTS, _generate  # the same greedy run
from tiny_models import CORPUS

# a peer's calibration counts toward the first test that needs its checkpoint: on a loaded
# 2-core machine that can pass the suite's 300 s default
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _calibration(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(text, add_special_tokens=False)["input_ids"] for text in CORPUS[:10] * 2]


def bladellm_dequantized(model_dir: str) -> tuple[dict[str, torch.Tensor], str]:
    """Every quantized linear's weight by checkpoint name as BladeLLM's loader reads it (the
    engine's model, TP-aware parameter loaders, the format's unpacker, ``dequantize``)."""
    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.kernels import resolve_kernels
    from bladellm.kernels.scope import building_with
    from bladellm.model.loader import build_model, find_weight_files, load_checkpoint_files
    from bladellm.quantization import get_quant_config
    from bladellm.quantization.int_weight import dequantize
    from bladellm.quantization.method import QuantLinearMethod

    hf_config = load_hf_config(model_dir, False)
    quant = get_quant_config(hf_config)
    assert quant is not None
    kernels = resolve_kernels("auto", "cpu")
    with building_with(kernels):
        model = build_model(hf_config, torch.float32, "cpu", get_attn_backend(None, kernels),
                            quant_config=quant)
    load_checkpoint_files(model, find_weight_files(model_dir))
    out = {}
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuantLinearMethod):
            params = {n: getattr(layer, n).data for n in layer.quant_param_names}
            weight = dequantize(method.scheme.to_int_weight(params))
            parent, _, leaf = layer.prefix.rpartition(".")
            for name, part in zip(FUSED.get(leaf, (leaf,)),
                                  weight.split(list(layer.output_partition_sizes))):
                out[f"{parent}.{name}.weight"] = part
    assert len(out) == 7 * hf_config.num_hidden_layers
    return out, quant.describe()


@torch.no_grad()
def _greedy(model) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        gen = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(gen[0, len(p):].tolist())
    return out


# --- llm-compressor ---------------------------------------------------------------------------


def _args(bits: int, group_size: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size > 0 else "channel",
                            group_size=group_size if group_size > 0 else None)


def _recipe(name: str) -> list:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    def groups(weights, acts=None):
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                              input_activations=acts)}
    if name == "gptq-w4a16-g32":  # llm-compressor's default actorder ("static") included
        return [GPTQModifier(config_groups=groups(_args(4, 32, True)), ignore=["lm_head"])]
    if name == "awq-w4a16-g32-asym":  # zero points packed along the output
        return [AWQModifier(), QuantizationModifier(config_groups=groups(_args(4, 32, False)),
                                                    ignore=["lm_head"])]
    if name == "gptq-w8a16-channel":
        return [GPTQModifier(config_groups=groups(_args(8, -1, True)), ignore=["lm_head"])]
    if name == "sq-w8a8":
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                dynamic=True)
        return [SmoothQuantModifier(smoothing_strength=0.5),
                QuantizationModifier(config_groups=groups(_args(8, -1, True), acts),
                                     ignore=["lm_head"])]
    raise KeyError(name)


LLMC = ["gptq-w4a16-g32", "awq-w4a16-g32-asym", "gptq-w8a16-channel", "sq-w8a8"]


@pytest.fixture(scope="module")
def llmc_checkpoint(tiny_llama, tmp_path_factory):
    pytest.importorskip("llmcompressor")
    import datasets
    import transformers
    from llmcompressor import oneshot

    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        # llm-compressor 0.14's AWQ pins cached activations for host-to-GPU copies
        # unconditionally, which raises without an accelerator; pinning changes no value
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            out = str(tmp_path_factory.mktemp(f"llmc-{name}"))
            model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                                      dtype=torch.float32)
            tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
            calib = _calibration(tiny_llama)
            ds = datasets.Dataset.from_list(
                [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calib])
            oneshot(model=model, tokenizer=tok, dataset=ds, recipe=_recipe(name),
                    num_calibration_samples=len(calib), shuffle_calibration_samples=False,
                    pipeline="sequential")
            model.save_pretrained(out, save_compressed=True)
            tok.save_pretrained(out)
            cache[name] = out
        return cache[name]
    return get


def _llmc_decompressed(model_dir: str):
    """The checkpoint as transformers + compressed-tensors load it, decompressed to float
    weights by compressed-tensors itself (``run_compressed=False``)."""
    import transformers
    from transformers import CompressedTensorsConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()


@pytest.mark.parametrize("name", LLMC)
def test_llmcompressor_weights_equal_its_own_decompression(llmc_checkpoint, name):
    model_dir = llmc_checkpoint(name)
    ours, desc = bladellm_dequantized(model_dir)
    assert desc.startswith("compressed-tensors")
    theirs = _llmc_decompressed(model_dir).state_dict()
    for key, weight in ours.items():
        assert theirs[key].dtype == torch.float32
        assert torch.equal(weight, theirs[key]), key


@pytest.mark.parametrize("name", [n for n in LLMC if "a8" not in n])
def test_llmcompressor_checkpoint_decodes_like_transformers(llmc_checkpoint, name):
    model_dir = llmc_checkpoint(name)
    assert _generate(model_dir) == _greedy(_llmc_decompressed(model_dir))


# --- GPTQModel --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gptqmodel_checkpoint(tiny_llama, tmp_path_factory) -> str:
    # its CPU pool is sized (cores + 1) // 2, below the 2 workers its loader pool asks for on a
    # 2-core machine; the documented override (read at import)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    gptqmodel = pytest.importorskip("gptqmodel")
    out = str(tmp_path_factory.mktemp("gptqmodel"))
    cfg = gptqmodel.QuantizeConfig(bits=4, group_size=32, sym=False, desc_act=False)
    model = gptqmodel.GPTQModel.load(tiny_llama, cfg, device="cpu", dtype=torch.float32)
    model.quantize([{"input_ids": ids, "attention_mask": [1] * len(ids)}
                    for ids in _calibration(tiny_llama)], batch_size=1)
    model.save(out)
    return out


def _gptqmodel_dequantized(model_dir: str) -> dict[str, torch.Tensor]:
    """GPTQModel's own dequantization (its plain-PyTorch ``TorchLinear``, float16 only)."""
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(model_dir, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    out = {}
    for name, module in model.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            out[name + ".weight"] = module.dequantize_weight().t()  # [in, out] -> [out, in]
    return out


def test_gptqmodel_weights_equal_its_own_dequantization(gptqmodel_checkpoint):
    ours, desc = bladellm_dequantized(gptqmodel_checkpoint)
    assert desc.startswith("gptq 4-bit group 32 asym")
    theirs = _gptqmodel_dequantized(gptqmodel_checkpoint)
    assert set(ours) == set(theirs)
    for key, weight in ours.items():
        # GPTQModel multiplies in float16; ours is the exact product (an fp16 scale times a
        # small integer) in float32, which rounds to the same float16
        assert theirs[key].dtype == torch.float16
        assert torch.equal(weight.half(), theirs[key]), key


def test_gptqmodel_checkpoint_decodes_like_transformers(tiny_llama, gptqmodel_checkpoint):
    import transformers

    from safetensors.torch import load_file

    theirs = _gptqmodel_dequantized(gptqmodel_checkpoint)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    state = ref.state_dict()
    for f in os.listdir(gptqmodel_checkpoint):  # the float tensors as GPTQModel saved them
        if f.endswith(".safetensors"):
            state.update({k: v.float() for k, v in
                          load_file(os.path.join(gptqmodel_checkpoint, f)).items()
                          if k in state})
    state.update({k: v.float() for k, v in theirs.items()})
    ref.load_state_dict(state)
    assert _generate(gptqmodel_checkpoint) == _greedy(ref.eval())
