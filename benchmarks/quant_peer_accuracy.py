"""Perplexity of ``blade_llm_quantize`` against llm-compressor and GPTQModel on the same model,
calibration tokens and held-out text (docs/quantization.md, "Accuracy against other tools").

Every checkpoint — ours and the peers' — is scored the same way: it is loaded by BladeLLM's own
loader (``build_model`` + ``load_checkpoint_files`` with the checkpoint's ``quantization_config``,
the TP-aware parameter loaders, then each format's ``to_int_weight``), dequantized with
``int_weight.dequantize`` and put into the transformers model (W8A8 also fake-quantizes each
linear's input per token to int8, as the serving kernel does), then scored like
``benchmarks/quant_accuracy.py`` (Vim user manual: chapters 01-12 held out, 20-32 calibration).
So a peer's row also shows that BladeLLM reads that peer's output.

The calibration chunks are made by our tool's own ``tokenize_calibration`` and handed to every
peer as pre-tokenized ``input_ids``: all tools see the same tokens.

    # llm-compressor / GPTQModel live in a venv beside the system torch (install_quant_peers.sh)
    /tmp/qpeers/bin/python benchmarks/quant_peer_accuracy.py \
        --runs ours-gptq,llmc-gptq,ours-awq,llmc-awq,ours-smoothquant,llmc-sq-rtn-w8a8 \
        --eval_tokens 2048 --num_calib_samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from quant_accuracy import (  # noqa: E402
    demo_hf_dir, eval_windows_and_calib_file, perplexity)

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# ---------------------------------------------------------------------------------------------
# Scoring through BladeLLM's loader


def bladellm_dequantized(qdir: str) -> tuple[dict[str, torch.Tensor], bool, str]:
    """The float ``[out, in]`` weight of every quantized linear of ``qdir`` by transformers
    name (fused layers split back), as BladeLLM's loader reads it; whether it is W8A8; the
    loader's description of the format."""
    from bladellm.attention import get_attn_backend
    from bladellm.checkpoint.hf_config import load_hf_config
    from bladellm.kernels import resolve_kernels
    from bladellm.kernels.scope import building_with
    from bladellm.model.loader import build_model, find_weight_files, load_checkpoint_files
    from bladellm.quantization import get_quant_config
    from bladellm.quantization.int_weight import dequantize
    from bladellm.quantization.method import QuantLinearMethod

    hf_config = load_hf_config(qdir, False)
    quant = get_quant_config(hf_config)
    if quant is None:
        raise ValueError(f"{qdir}: not a quantized checkpoint")
    kernels = resolve_kernels("auto", "cpu")
    with building_with(kernels):
        model = build_model(hf_config, torch.float32, "cpu", get_attn_backend(None, kernels),
                            quant_config=quant)
    load_checkpoint_files(model, find_weight_files(qdir))
    out: dict[str, torch.Tensor] = {}
    w8a8 = False
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, QuantLinearMethod):
            continue
        w8a8 |= method.scheme.kind == "w8a8"
        params = {n: getattr(layer, n).data for n in layer.quant_param_names}
        weight = dequantize(method.scheme.to_int_weight(params))
        parent, _, leaf = layer.prefix.rpartition(".")
        parts = FUSED.get(leaf, (leaf,))
        for name, piece in zip(parts, weight.split(list(layer.output_partition_sizes))):
            out[f"{parent}.{name}.weight"] = piece.contiguous()
    return out, w8a8, quant.describe()


def _float_tensors(qdir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's float tensors (norms, embeddings: AWQ / SmoothQuant change the norms)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(qdir)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(qdir, f)).items():
                if v.is_floating_point() and (k.endswith("norm.weight") or "embed" in k
                                              or k.startswith("lm_head")):
                    out[k] = v.float()
    return out


@torch.no_grad()
def load_via_bladellm(src: str, qdir: str):
    import transformers

    from bladellm.quantization.algorithms.quantizer import fake_quantize_act_per_token

    linears, w8a8, desc = bladellm_dequantized(qdir)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {**_float_tensors(qdir), **linears}
    missing = [k for k in linears if k not in model.state_dict()]
    assert not missing, missing
    expect = {k for k in model.state_dict() if k.endswith("_proj.weight") and ".layers." in k}
    assert expect == set(linears), sorted(expect ^ set(linears))[:4]
    _, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    if w8a8:
        for name, module in model.named_modules():
            if name + ".weight" in linears:
                module.register_forward_pre_hook(
                    lambda _m, a: (fake_quantize_act_per_token(a[0]),))
    return model.eval(), desc


# ---------------------------------------------------------------------------------------------
# Producers: each writes a checkpoint into ``out`` and returns notes for the table


def _scheme(bits: int, group_size: int, acts: bool = False):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=True,
                               strategy="group" if group_size > 0 else "channel",
                               group_size=group_size if group_size > 0 else None)
    inputs = (QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                               dynamic=True) if acts else None)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                          input_activations=inputs)}


def llmc_cpu_workaround() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (``IntermediatesCache.pin_memory``,
    only there to speed up host-to-GPU copies) unconditionally, which raises "Cannot access
    accelerator device when none is available" on a CPU-only torch. Pinning changes no value,
    so without an accelerator it is skipped."""
    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def _llmc(recipe_fn: Callable[[int], list], src: str, out: str, calib: list[torch.Tensor],
          ns) -> dict:
    import datasets
    import transformers
    from llmcompressor import oneshot

    llmc_cpu_workaround()

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    rows = [{"input_ids": c[0].tolist(), "attention_mask": [1] * c.shape[1]} for c in calib]
    ds = datasets.Dataset.from_list(rows)
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe_fn(ns.group_size),
            num_calibration_samples=len(rows), max_seq_length=ns.calib_data_max_len,
            shuffle_calibration_samples=False, pipeline="sequential")
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    return {}


def llmc_gptq(g: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups=_scheme(4, g), ignore=["lm_head"])]


def llmc_awq(g: int) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    # llm-compressor's defaults (duo_scaling, 20 grid points, no clipping search); the
    # QuantizationModifier that follows rounds the smoothed weights to nearest
    return [AWQModifier(), QuantizationModifier(config_groups=_scheme(4, g), ignore=["lm_head"])]


def llmc_sq_gptq_w8a8(_g: int) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    return [SmoothQuantModifier(smoothing_strength=0.5),
            GPTQModifier(config_groups=_scheme(8, -1, acts=True), ignore=["lm_head"])]


def llmc_sq_rtn_w8a8(_g: int) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    return [SmoothQuantModifier(smoothing_strength=0.5),
            QuantizationModifier(config_groups=_scheme(8, -1, acts=True), ignore=["lm_head"])]


def gptqmodel_gptq(src: str, out: str, calib: list[torch.Tensor], ns) -> dict:
    # GPTQModel sizes its CPU pool as (cores + 1) // 2 = 1 on a 2-core machine, below the 2
    # workers its own model-loader pool asks for ("Virtual pool 'model_loader:cpu' requests 2
    # workers but parent 'cpu' only has 1"); its documented override raises it.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel, QuantizeConfig

    # damp_percent as ours and llm-compressor's (GPTQModel's default is 0.05); the rest default
    cfg = QuantizeConfig(bits=4, group_size=ns.group_size, sym=True, desc_act=False,
                         damp_percent=0.01)
    # float32 like every other run (GPTQModel picks bfloat16 on CPU by default)
    model = GPTQModel.load(src, cfg, device="cpu", dtype=torch.float32)
    rows = [{"input_ids": c[0].tolist(), "attention_mask": [1] * c.shape[1]} for c in calib]
    model.quantize(rows, batch_size=1)
    model.save(out)
    return {}


def gptqmodel_awq(src: str, out: str, calib: list[torch.Tensor], ns) -> dict:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # as gptqmodel_gptq
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.config import AWQConfig

    # AutoAWQ's GEMM layout (asymmetric: zero points), GPTQModel's AWQ defaults otherwise
    cfg = AWQConfig(bits=4, group_size=ns.group_size, format="gemm")
    # bfloat16: GPTQModel's AWQ modules refuse float32 (AwqTorchLinear: fp16/bf16 only), and
    # bf16 is GPTQModel's own CPU default
    model = GPTQModel.load(src, cfg, device="cpu", dtype=torch.bfloat16)
    rows = [{"input_ids": c[0].tolist(), "attention_mask": [1] * c.shape[1]} for c in calib]
    model.quantize(rows, batch_size=1)
    model.save(out)
    return {}


def ours(algo: str, act_order: bool = False) -> Callable:
    def run(src: str, out: str, calib_file: str, ns) -> dict:
        from bladellm.quantization.algorithms.config import QuantizeConfig
        from bladellm.quantization.algorithms.pipeline import quantize_checkpoint

        w8a8 = algo == "smoothquant"
        cfg = QuantizeConfig(
            model=src, output_dir=out, quant_algo=algo, bit=8 if w8a8 else 4,
            group_size=-1 if w8a8 else ns.group_size, calib_data=calib_file,
            calib_data_max_len=ns.calib_data_max_len, num_calib_samples=ns.num_calib_samples,
            act_order=act_order, overwrite=True)
        quantize_checkpoint(cfg, progress=False)
        return {}
    return run


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "gptqmodel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


RUNS = {
    "ours-gptq": ("gptq", "int4 g{g} sym", ours("gptq")),
    "ours-gptq-act-order": ("gptq --act_order", "int4 g{g} sym, desc_act", ours("gptq", True)),
    "ours-awq": ("awq", "int4 g{g} sym", ours("awq")),
    "ours-smoothquant+": ("smoothquant+", "int4 g{g} sym", ours("smoothquant+")),
    "ours-smoothquant": ("smoothquant", "W8A8", ours("smoothquant")),
    "llmc-gptq": ("llm-compressor GPTQModifier", "int4 g{g} sym", llmc_gptq),
    "llmc-awq": ("llm-compressor AWQModifier + RTN", "int4 g{g} sym", llmc_awq),
    "llmc-sq-gptq-w8a8": ("llm-compressor SmoothQuant + GPTQ", "W8A8", llmc_sq_gptq_w8a8),
    "llmc-sq-rtn-w8a8": ("llm-compressor SmoothQuant + RTN", "W8A8", llmc_sq_rtn_w8a8),
    "gptqmodel-gptq": ("GPTQModel", "int4 g{g} sym", gptqmodel_gptq),
    "gptqmodel-awq": ("GPTQModel AWQ (gemm)", "int4 g{g} asym", gptqmodel_awq),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--eval_tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--group_size", type=int, default=64)
    ap.add_argument("--num_calib_samples", type=int, default=4)
    ap.add_argument("--calib_data_max_len", type=int, default=512)
    ap.add_argument("--work_dir", default="/tmp/quant_peer_accuracy")
    ap.add_argument("--results", default=None, help="JSONL file to append each row to")
    ap.add_argument("--skip_float", action="store_true")
    ns = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration

    os.makedirs(ns.work_dir, exist_ok=True)
    src = demo_hf_dir(ns.work_dir) if ns.model == "demo" else ns.model
    tok = AutoTokenizer.from_pretrained(src)
    windows, calib_file, num_eval = eval_windows_and_calib_file(tok, ns.work_dir,
                                                                ns.eval_tokens, ns.window)
    # exactly the chunks our tool calibrates on (same reader, same tokenizer, same cut)
    calib = tokenize_calibration(tok, load_calibration_texts(calib_file),
                                 ns.calib_data_max_len, ns.num_calib_samples)

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if ns.results:
            with open(ns.results, "a") as f:
                f.write(json.dumps(row) + "\n")

    record({"run": "meta", "versions": _versions(), "threads": torch.get_num_threads(),
            "calib": [int(c.shape[1]) for c in calib], "eval_tokens": num_eval})
    if not ns.skip_float:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        record({"run": "float32", "ppl": perplexity(model, windows)})
    for name in ns.runs.split(","):
        label, weights, fn = RUNS[name]
        out = os.path.join(ns.work_dir, name.replace("+", "plus"))
        row = {"run": name, "tool": label, "weights": weights.format(g=ns.group_size)}
        start = time.perf_counter()
        try:
            if name.startswith("ours-"):
                fn(src, out, calib_file, ns)
            elif name.startswith("llmc-"):
                _llmc(fn, src, out, calib, ns)
            else:
                fn(src, out, calib, ns)
        except Exception as e:  # a peer that cannot run here is a row saying why
            traceback.print_exc()
            record({**row, "error": f"quantize: {type(e).__name__}: {e}"[:500]})
            continue
        row["quantize_s"] = round(time.perf_counter() - start, 1)
        with open(os.path.join(out, "config.json")) as f:
            row["quantization_config"] = json.load(f).get("quantization_config")
        try:
            model, desc = load_via_bladellm(src, out)
        except Exception as e:
            traceback.print_exc()
            record({**row, "error": f"bladellm load: {type(e).__name__}: {e}"[:500]})
            continue
        row["bladellm_format"] = desc
        row["ppl"] = perplexity(model, windows)
        record(row)


if __name__ == "__main__":
    main()
