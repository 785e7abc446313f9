"""What blade_llm_quantize writes: tensor names, dtypes, shapes, config, and that reading the
packed integers back (tests' own unpacker) gives exactly the algorithm's integers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bladellm.quantization.algorithms.layer_io import LINEAR_NAMES
from bladellm.quantization.algorithms.quantizer import GroupQuantSpec, QuantizedWeight
from bladellm.quantization.algorithms.writer import pack_gptq

from .helpers import quantize
from .reference import read_checkpoint, unpack_qweight, unpack_qzeros

HIDDEN, INTER = 64, 128


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (4, -1, False), (8, 16, False),
                                                 (8, -1, True)])
def test_pack_round_trip(bits, group_size, sym):
    gen = torch.Generator().manual_seed(bits + group_size)
    out_f, in_f = 24, 64
    spec = GroupQuantSpec(bits, group_size, sym)
    groups = spec.groups_of(in_f)
    q = torch.randint(0, 2 ** bits, (out_f, in_f), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 2 ** bits, (groups, out_f), generator=gen, dtype=torch.int32)
    g_idx = torch.randperm(in_f, generator=gen).to(torch.int32) // spec.effective_group_size(in_f)
    qw = QuantizedWeight(q, torch.rand(groups, out_f, generator=gen), zeros, g_idx, spec)
    packed = pack_gptq(qw)
    assert packed["qweight"].dtype == torch.int32 and packed["qzeros"].dtype == torch.int32
    assert packed["qweight"].shape == (in_f * bits // 32, out_f)
    assert packed["qzeros"].shape == (groups, out_f * bits // 32)
    assert torch.equal(unpack_qweight(packed["qweight"], bits), q.t().long())
    assert torch.equal(unpack_qzeros(packed["qzeros"], bits), zeros.long())
    assert torch.equal(packed["g_idx"], g_idx)
    assert packed["scales"].dtype == torch.float16


@pytest.mark.parametrize("algo", ["minmax", "gptq", "awq", "smoothquant+"])
def test_weight_only_checkpoint(algo, tiny_llama, calib_file, tmp_path):
    cfg, rec = quantize(tiny_llama, str(tmp_path / "q"), algo, calib_file)
    t = read_checkpoint(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "config.json")) as f:
        config = json.load(f)
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym",
                               "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
    assert qc["meta"]["quant_algo"] == algo and qc["meta"]["quantizer"][0].startswith(
        "blade_llm_quantize")
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == HIDDEN
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "quantize_config.json"):
        assert os.path.isfile(os.path.join(cfg.output_dir, name)), name
    assert len(rec.results) == 2
    for i, result in enumerate(rec.results):
        assert set(result) == set(LINEAR_NAMES)
        for n, qw in result.items():
            p = f"model.layers.{i}.{n}"
            out_f, in_f = qw.qweight.shape
            assert p + ".weight" not in t
            assert t[p + ".qweight"].shape == (in_f // 8, out_f)
            assert t[p + ".qzeros"].shape == (in_f // 32, out_f // 8)
            assert t[p + ".scales"].shape == (in_f // 32, out_f)
            assert t[p + ".scales"].dtype == torch.float16
            assert t[p + ".g_idx"].dtype == torch.int32
            assert torch.equal(t[p + ".g_idx"], torch.arange(in_f, dtype=torch.int32) // 32)
            assert torch.equal(unpack_qweight(t[p + ".qweight"], 4), qw.qweight.t().long())
            assert torch.equal(unpack_qzeros(t[p + ".qzeros"], 4), qw.zeros.long())
            assert torch.equal(qw.zeros, torch.full_like(qw.zeros, 8))  # sym: 2^(bits-1)
            assert torch.equal(t[p + ".scales"], qw.scales.half())
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert t[f"model.layers.{i}.{norm}.weight"].shape == (HIDDEN,)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert t[name].dtype == torch.float32


def test_w8a8_checkpoint(tiny_llama, calib_file, tmp_path):
    cfg, rec = quantize(tiny_llama, str(tmp_path / "q"), "smoothquant", calib_file)
    t = read_checkpoint(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy",
                                             "dynamic")} == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "symmetric",
                                                       "strategy", "dynamic")} == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert qc["bladellm"]["quant_algo"] == "smoothquant" and qc["bladellm"]["alpha"] == 0.5
    for i, result in enumerate(rec.results):
        for n, qw in result.items():
            p = f"model.layers.{i}.{n}"
            assert t[p + ".weight"].dtype == torch.int8
            assert torch.equal(t[p + ".weight"], qw.qweight)
            assert t[p + ".weight_scale"].shape == (qw.qweight.shape[0], 1)
            assert torch.equal(t[p + ".weight_scale"], qw.scale)
            assert p + ".weight_zero_point" not in t  # symmetric: none, as llm-compressor
            assert int(t[p + ".weight"].abs().max()) >= 127


def test_act_order_g_idx(tiny_llama, calib_file, tmp_path):
    """desc_act: columns are quantized in order of decreasing Hessian diagonal; the k-th column
    in that order belongs to group k // group_size; dequantizing through g_idx is close to the
    float weight."""
    import transformers

    from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration

    cfg, rec = quantize(tiny_llama, str(tmp_path / "q"), "gptq", calib_file, act_order=True)
    t = read_checkpoint(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "config.json")) as f:
        assert json.load(f)["quantization_config"]["desc_act"] is True
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    samples = tokenize_calibration(tok, load_calibration_texts(calib_file), 32, 6)
    xs = []
    q_proj = model.model.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda _m, a: xs.append(a[0].reshape(-1, HIDDEN)))
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids)
    handle.remove()
    diag = torch.cat(xs).pow(2).sum(0)
    perm = torch.argsort(diag, descending=True)
    g_idx = t["model.layers.0.self_attn.q_proj.g_idx"]
    assert torch.equal(g_idx[perm], (torch.arange(HIDDEN) // 32).to(torch.int32))
    assert not torch.equal(g_idx, (torch.arange(HIDDEN) // 32).to(torch.int32))
    for i, result in enumerate(rec.results):
        for n, qw in result.items():
            assert torch.equal(t[f"model.layers.{i}.{n}.g_idx"], qw.g_idx)
            assert torch.bincount(qw.g_idx.long()).tolist() == [32] * (qw.g_idx.numel() // 32)


def test_benchmark_dequantizer_matches_reference(tiny_llama, calib_file, tmp_path):
    """benchmarks/quant_accuracy.py scores checkpoints through its own vectorized unpacker: it
    must read exactly what the tests' reference reads (asym 8-bit with act-order here)."""
    import importlib.util

    from .reference import dequantize_gptq

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    spec = importlib.util.spec_from_file_location(
        "quant_accuracy", os.path.join(root, "benchmarks", "quant_accuracy.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg, _ = quantize(tiny_llama, str(tmp_path / "q"), "gptq", calib_file, bit=8, sym=False,
                      act_order=True)
    t = read_checkpoint(cfg.output_dir)
    with open(os.path.join(cfg.output_dir, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    for n in LINEAR_NAMES:
        p = f"model.layers.1.{n}"
        assert torch.equal(bench.dequantize_linear(t, p, qcfg), dequantize_gptq(t, p, 8))
