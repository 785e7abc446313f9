"""``blade_llm_quantize``: quantize a float checkpoint offline (docs/quantization_tool.md).

    blade_llm_quantize --model /models/llama --output_dir /models/llama-gptq \\
        --quant_algo gptq --bit 4 --group_size 128 --calib_data calib.txt

Weight-only results (minmax, gptq, awq, smoothquant+) are written in the GPTQ checkpoint format
(AutoGPTQ / GPTQModel v1 layout); smoothquant's W8A8 in compressed-tensors ``int-quantized``
(llm-compressor's layout). The algorithms live in ``bladellm/quantization/algorithms``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys

from bladellm.checkpoint.chatglm import is_chatglm
from bladellm.entrypoints.cli.output_dir import first_missing
from bladellm.quantization.algorithms.config import (CALIBRATED_ALGOS, QUANT_ALGOS,
                                                     QUANT_ARCHITECTURES, QuantizeConfig)

logger = logging.getLogger("bladellm.quantize")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blade_llm_quantize", allow_abbrev=False,
        description="Quantize a Hugging Face checkpoint (Llama family, safetensors) to a GPTQ "
                    "or compressed-tensors checkpoint that blade_llm_server, vLLM and SGLang "
                    "load.")

    def add(flag: str, **kw) -> None:
        names = [flag] + ([flag.replace("_", "-")] if "_" in flag else [])
        p.add_argument(*names, **kw)

    add("--model", required=True, help="Source model directory (safetensors); 'demo': the "
                                        "demo model's cached dense copy.")
    add("--output_dir", required=True, help="Directory to write the quantized checkpoint to.")
    add("--quant_algo", default="minmax", choices=QUANT_ALGOS,
        help="minmax (default): round to nearest, no calibration; gptq; awq; smoothquant: "
             "W8A8 int8; smoothquant+: smoothing with a searched strength, then weight-only.")
    add("--quant_mode", default=None, choices=["weight_only_quant", "act_and_weight_quant"],
        help="The product's flag, implied by --quant_algo (act_and_weight_quant for "
             "smoothquant, weight_only_quant otherwise); a contradicting value is an error.")
    add("--bit", type=int, default=8, choices=[4, 8], help="Weight bits (default 8).")
    add("--group_size", type=int, default=None,
        help="Input features per quantization group, -1 for one per output channel "
             "(default -1; 64 with --block_wise_quant).")
    add("--block_wise_quant", action="store_true",
        help="The product's flag: group-wise weights with --group_size 64.")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True,
                     help="Symmetric weights, zero point 2^(bit-1) (default).")
    sym.add_argument("--no-sym", "--no_sym", "--asym", dest="sym", action="store_false",
                     help="Asymmetric weights with a zero point per group.")
    add("--act_order", action="store_true",
        help="gptq: quantize columns by decreasing Hessian diagonal (desc_act, writes g_idx).")
    add("--calib_data", default=None,
        help="Calibration text: a .txt file (one sample per paragraph, or per line), a .jsonl "
             "file with a 'text' field per line, or the text itself.")
    # default None: a value given for an algorithm that does not use it is refused even when it
    # equals the default (config_from_args); QuantizeConfig's own defaults apply otherwise.
    add("--calib_data_max_len", type=int, default=None,
        help="Tokens per calibration sample (default 512).")
    add("--num_calib_samples", type=int, default=None,
        help="Number of calibration samples (default 128; fewer when the text runs out).")
    add("--cpu_offload", action="store_true",
        help="Hold one decoder layer in memory at a time (read from the safetensors files "
             "when needed) instead of the whole model.")
    add("--alpha", type=float, default=None,
        help="smoothquant: migration strength (default 0.5).")
    add("--damp_percent", type=float, default=None,
        help="gptq: dampening added to the Hessian diagonal, relative to its mean "
             "(default 0.01).")
    add("--no_awq_clip", action="store_true", help="awq: skip the weight clipping search.")
    add("--overwrite", action="store_true", help="Write into a non-empty --output_dir.")
    return p


def config_from_args(ns: argparse.Namespace) -> QuantizeConfig:
    algo = ns.quant_algo
    mode = "act_and_weight_quant" if algo == "smoothquant" else "weight_only_quant"
    if ns.quant_mode is not None and ns.quant_mode != mode:
        raise ValueError(f"--quant_mode {ns.quant_mode}: --quant_algo {algo} is "
                         f"{mode}")
    # Given (not None) but unused by the algorithm: refused even at the default value, which
    # QuantizeConfig cannot tell apart from a flag left out.
    calibrated = algo in CALIBRATED_ALGOS
    for flag, value, used in (("--damp_percent", ns.damp_percent, algo == "gptq"),
                              ("--calib_data_max_len", ns.calib_data_max_len, calibrated),
                              ("--num_calib_samples", ns.num_calib_samples, calibrated)):
        if value is not None and not used:
            raise ValueError(f"{flag}: {algo} does not use it; leave it out")
    if ns.block_wise_quant and algo == "smoothquant":  # named as typed, not as --group_size 64
        raise ValueError("--block_wise_quant: smoothquant's int8 weights are per output "
                         "channel, not group-wise")
    group_size = ns.group_size
    if ns.block_wise_quant:
        if group_size not in (None, 64):
            raise ValueError(f"--block_wise_quant means --group_size 64, got --group_size "
                             f"{group_size}")
        group_size = 64
    return QuantizeConfig(
        # ~ expanded here as for --model: `--output_dir=~/x` reaches us unexpanded by the shell
        model=_model_dir(ns.model), output_dir=os.path.expanduser(ns.output_dir),
        quant_algo=ns.quant_algo,
        bit=ns.bit,
        group_size=-1 if group_size is None else group_size,
        sym=ns.sym, act_order=ns.act_order, calib_data=ns.calib_data,
        cpu_offload=ns.cpu_offload, alpha=ns.alpha, awq_clip=not ns.no_awq_clip,
        overwrite=ns.overwrite,
        **{k: getattr(ns, k) for k in ("calib_data_max_len", "num_calib_samples", "damp_percent")
           if getattr(ns, k) is not None})


def check_paths(cfg: QuantizeConfig) -> None:
    from bladellm.quantization.calib import load_calibration_texts

    if cfg.calib_data:
        load_calibration_texts(cfg.calib_data)  # a missing file fails before any work
    model_dir = os.path.expanduser(cfg.model)
    if not os.path.isdir(model_dir):
        raise ValueError(f"--model: {cfg.model} is not a directory")
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model: cannot read {path}: {e}") from e
    if raw.get("quantization_config"):
        raise ValueError(f"--model: {cfg.model} is already quantized (quantization_config); "
                         f"start from the float checkpoint")
    chatglm = is_chatglm(raw)
    if chatglm:
        raw = _chatglm_as_glm(cfg, model_dir, raw)
    archs = raw.get("architectures") or []
    if not any(a in QUANT_ARCHITECTURES for a in archs):
        raise ValueError(f"--model: architecture {', '.join(archs) or '(none in config.json)'} "
                         f"is not supported; blade_llm_quantize supports "
                         f"{', '.join(QUANT_ARCHITECTURES)}")
    _check_moe(cfg, archs)
    _check_tensors(cfg.model, model_dir, raw, chatglm)
    _check_group_size(cfg, raw)
    if os.path.isfile(cfg.output_dir):
        raise ValueError(f"--output_dir: {cfg.output_dir} is a file")
    if os.path.isdir(cfg.output_dir) and os.listdir(cfg.output_dir):
        if not cfg.overwrite:
            raise ValueError(f"--output_dir: {cfg.output_dir} is not empty; pass --overwrite "
                             f"to replace it")
        _remove_previous_output(cfg.output_dir)


def _chatglm_as_glm(cfg: QuantizeConfig, model_dir: str, raw: dict) -> dict:
    """A ChatGLM2/3 checkpoint is quantized as the transformers GlmForCausalLM of the same
    weights (``model_source.py``) and written as a GLM checkpoint: returns that config.json.
    What cannot work is refused here, naming the flag."""
    from bladellm.quantization.algorithms.model_source import glm_config_of_chatglm

    if cfg.cpu_offload:
        raise ValueError("--cpu_offload: not supported for ChatGLM checkpoints (they are "
                         "converted to GLM in memory); quantize without it")
    glm = glm_config_of_chatglm(raw).to_dict()  # a variant outside the layout: names the field
    if cfg.quant_algo in CALIBRATED_ALGOS and not os.path.isfile(
            os.path.join(model_dir, "tokenizer.json")):
        tok = os.path.join(model_dir, "tokenizer_config.json")
        auto_map = {}
        if os.path.isfile(tok):
            with open(tok) as f:
                auto_map = json.load(f).get("auto_map") or {}
        if auto_map:
            raise ValueError(f"--quant_algo {cfg.quant_algo}: the tokenizer of {cfg.model} that "
                             f"would tokenize --calib_data is the directory's own code "
                             f"({auto_map.get('AutoTokenizer')}), which blade_llm_quantize does "
                             f"not run; add its tokenizer.json (fast tokenizer) or use "
                             f"--quant_algo minmax")
    logger.info("%s is a ChatGLM checkpoint (%s): quantizing it as transformers' "
                "GlmForCausalLM of the same weights; %s will be a GLM checkpoint "
                "(GlmForCausalLM) of the same model", cfg.model,
                ", ".join(raw.get("architectures") or ["model_type chatglm"]), cfg.output_dir)
    return glm


def _check_moe(cfg: QuantizeConfig, archs: list[str]) -> None:
    """Every --quant_algo quantizes a mixture of experts (AWQ / SmoothQuant compensate the float
    router: layouts.moe_layout); --cpu_offload does not (transformers reads experts stacked)."""
    from bladellm.quantization.algorithms.moe import moe_architecture

    arch = moe_architecture(archs)
    if arch is None:
        return
    if cfg.cpu_offload:
        raise ValueError(f"--cpu_offload: not supported for the mixture-of-experts {arch}")


# Tensor suffixes of packed quantized weights (GPTQ / AWQ, compressed-tensors).
_PACKED_SUFFIXES = (".qweight", ".qzeros", ".weight_scale", ".weight_packed")


def _check_tensors(model: str, model_dir: str, raw: dict, chatglm: bool = False) -> None:
    """Every decoder layer's float linears and norms are in the checkpoint: transformers would
    initialize a missing one at random and we would quantize noise without a word. A checkpoint
    quantized without ``quantization_config`` in config.json (AutoGPTQ's quantize_config.json,
    packed tensors) is named as such."""
    from bladellm.quantization.algorithms.layouts import EMBEDDINGS, layout_of_config
    from bladellm.quantization.algorithms.model_source import layer_prefix, weight_files
    from bladellm.quantization.algorithms.moe import moe_architecture, required_mlp_tensors

    if os.path.isfile(os.path.join(model_dir, "quantize_config.json")):
        raise ValueError(f"--model: {model} is already quantized (quantize_config.json); start "
                         f"from the float checkpoint")
    names = weight_files(model_dir)
    packed = sorted(n for n in names if n.endswith(_PACKED_SUFFIXES))
    if packed:
        raise ValueError(f"--model: {model} is already quantized ({packed[0]}); start from the "
                         f"float checkpoint")
    if chatglm:  # checked under the GLM names it is quantized by
        names = _glm_names(names)
    layout = layout_of_config(raw)
    prefix = layer_prefix(names)
    # a mixture of experts: the family's attention, the MLP per layer (sparse or dense) by moe.py
    moe = moe_architecture(raw.get("architectures") or [])
    linears = layout.attention_linear_names if moe else layout.linear_names
    per_layer = [f"{n}.weight" for n in linears + layout.norms]
    num_layers = raw.get("num_hidden_layers") or raw.get("n_layer") or 0  # Bloom: n_layer
    want = [EMBEDDINGS[prefix]] + [f"{prefix}{i}.{n}" for i in range(int(num_layers))
                      for n in per_layer + (required_mlp_tensors(raw, moe, i) if moe else [])]
    missing = [n for n in want if n not in names]
    if missing:
        raise ValueError(f"--model: {model} lacks {len(missing)} tensor(s) its layers need, "
                         f"e.g. {', '.join(missing[:3])}")


def _glm_names(names: dict[str, str]) -> set[str]:
    from bladellm.checkpoint.chatglm import glm_tensor_name

    out = set()
    for name in names:
        glm = glm_tensor_name(name)
        if glm is not None and ".self_attn.qkv_proj." in glm:
            out.update(glm.replace(".qkv_proj.", f".{p}.") for p in ("q_proj", "k_proj", "v_proj"))
        elif glm is not None:
            out.add(glm)
    return out


def _check_group_size(cfg: QuantizeConfig, raw: dict) -> None:
    """Early, from config.json (the layers are checked again when loaded)."""
    if cfg.group_size == -1:
        return
    hidden = raw.get("hidden_size")
    heads = raw.get("num_attention_heads") or raw.get("n_head")  # Bloom: n_head
    head_dim = raw.get("head_dim") or (hidden // heads if hidden and heads else None)
    bloom = "BloomForCausalLM" in (raw.get("architectures") or [])
    dims = {"hidden_size": hidden,
            "intermediate_size": raw.get("intermediate_size") or raw.get("ffn_dim") or (
                4 * hidden if bloom and hidden else None),
            "num_attention_heads * head_dim": heads * head_dim if heads and head_dim else None,
            # mixture of experts: the experts' and the shared expert's down_proj inputs
            "moe_intermediate_size": raw.get("moe_intermediate_size"),
            "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size")}
    for what, dim in dims.items():
        if dim and dim % cfg.group_size:
            raise ValueError(f"--group_size {cfg.group_size} does not divide the input features "
                             f"of the model's linears ({what} = {dim})")


def _remove_previous_output(output_dir: str) -> None:
    """The index first: a half-rewritten checkpoint must not look loadable. A previous GPTQ
    run's quantize_config.json goes too: a W8A8 run writes none, and AutoGPTQ would read it."""
    from bladellm.quantization.algorithms.writer import INDEX_FILE

    index = os.path.join(output_dir, INDEX_FILE)
    if os.path.exists(index):
        os.remove(index)
    for name in os.listdir(output_dir):
        if name.endswith(".safetensors") or name == "quantize_config.json":
            os.remove(os.path.join(output_dir, name))


def run(argv: list[str] | None = None):
    """Parse, validate and quantize; returns the report. ValueError names the bad flag.
    Whatever fails (or is interrupted) after the output directory was made removes what this
    run wrote: the directories it created, or its files in an existing --output_dir."""
    from bladellm.quantization.algorithms.pipeline import quantize_checkpoint

    cfg = config_from_args(make_parser().parse_args(argv))
    check_paths(cfg)
    created = first_missing(cfg.output_dir)
    before = set(os.listdir(cfg.output_dir)) if created is None else set()
    try:
        try:
            os.makedirs(cfg.output_dir, exist_ok=True)  # before the model is read, not after
        except OSError as e:
            raise ValueError(f"--output_dir: cannot create {cfg.output_dir}: {e}") from e
        return quantize_checkpoint(cfg)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif os.path.isdir(cfg.output_dir):
            _remove_previous_output(cfg.output_dir)  # the index first, then the shards
            for name in set(os.listdir(cfg.output_dir)) - before:
                path = os.path.join(cfg.output_dir, name)
                if os.path.isfile(path):
                    os.remove(path)
        raise


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        report = run(argv)
    except ValueError as exc:
        print(f"blade_llm_quantize: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report.output_dir}: {report.num_layers} layers, {report.weight_bytes} bytes "
          f"of weights, {report.num_calib_samples} calibration samples "
          f"({report.num_calib_tokens} tokens), {report.seconds:.1f} s")
    if report.expert_tokens:
        counts = [n for layer in report.expert_tokens.values() for n in layer]
        print(f"experts: {len(counts)}, calibration tokens per expert min {min(counts)} max "
              f"{max(counts)}; {len(report.uncalibrated_experts)} reached by none (quantized by "
              f"min-max round-to-nearest)"
              + (f": {', '.join(report.uncalibrated_experts)}" if report.uncalibrated_experts
                 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _model_dir(model: str) -> str:
    """``demo`` is the demo model's cached dense copy (a float folder); others as given."""
    if model != "demo":
        return model
    from bladellm.checkpoint.demo import demo_hf_dir

    return demo_hf_dir()
