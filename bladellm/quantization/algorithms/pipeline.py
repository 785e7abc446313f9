"""The sequential (layer by layer) quantization of a checkpoint, GPTQ-style.

1. Tokenize the calibration text; run the model up to decoder layer 0 and keep what enters it.
2. For each layer i: quantize it with the algorithm on those inputs; put the quantized weights
   back into the layer (dequantized; for W8A8 the linears' inputs are also fake-quantized per
   token), run it to get layer i+1's inputs, write its shard, forget it.
3. Copy the tensors outside the layers (embedding, final norm, lm_head) unchanged, the config
   with its ``quantization_config``, and the tokenizer files.

Mixture-of-experts layers are unfused into one linear per expert projection first
(algorithms/moe.py); the calibration tokens each expert saw are logged and reported, and the
experts none reached are named (quantized by the rule ``moe.UNCALIBRATED_RULE``, or the
algorithm's ``uncalibrated_rule``: AWQ's).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bladellm.quantization.algorithms.base import LayerAlgorithm, LayerResult
from bladellm.quantization.algorithms.config import QuantizeConfig
from bladellm.quantization.algorithms.layer_io import (LayerInputs, check_layer_layout,
                                                       decoder_layers, linear, run_layer)
from bladellm.quantization.algorithms.model_source import ModelSource
from bladellm.quantization.algorithms.moe import (MOE_ARCHITECTURES, UNCALIBRATED_RULE,
                                                  checkpoint_name, expert_token_counts,
                                                  moe_architecture, unfuse_experts)
from bladellm.quantization.algorithms.quantizer import (GroupQuantSpec, Int8ChannelWeight,
                                                        fake_quantize_act_per_token)

logger = logging.getLogger("bladellm.quantize")
TOOL_NAME = "blade_llm_quantize"
TOOL_VERSION = "0.1"


@dataclass
class QuantizeReport:
    output_dir: str
    num_layers: int
    num_calib_samples: int
    num_calib_tokens: int
    seconds: float
    weight_bytes: int
    algorithm_choices: dict[str, Any] = field(default_factory=dict)
    #: mixture of experts: calibration tokens per expert, by experts module
    #: (``model.layers.0.mlp.experts``), and the experts no calibration token reached
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)
    uncalibrated_experts: list[str] = field(default_factory=list)


def make_algorithm(cfg: QuantizeConfig) -> LayerAlgorithm:
    from bladellm.quantization.algorithms.awq import AWQ
    from bladellm.quantization.algorithms.gptq import GPTQ
    from bladellm.quantization.algorithms.minmax import MinMax
    from bladellm.quantization.algorithms.smoothquant import SmoothQuant, SmoothQuantPlus

    spec = GroupQuantSpec(cfg.bit, cfg.group_size, cfg.sym)
    return {
        "minmax": lambda: MinMax(spec),
        "gptq": lambda: GPTQ(spec, percdamp=cfg.damp_percent, act_order=cfg.act_order),
        "awq": lambda: AWQ(spec, clip=cfg.awq_clip),
        "smoothquant": lambda: SmoothQuant(cfg.smooth_alpha),
        "smoothquant+": lambda: SmoothQuantPlus(spec),
    }[cfg.quant_algo]()


class _StopForward(Exception):
    pass


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, samples: list[torch.Tensor]
                         ) -> tuple[LayerInputs, list[list[dict[str, Any]]]]:
    """Run the model's embedding (and mask / rotary set-up) and capture, per calibration sample,
    the hidden states entering decoder layer 0 and the keyword arguments every layer gets: they
    differ between layers where the model has local and global layers (Gemma: a sliding-window
    mask, and Gemma 3 a rotary table, per layer type). The layers themselves do not run (they
    hand their input on; the last one stops the forward), so offloaded layers stay unread."""
    layers = decoder_layers(model)
    hidden: list[torch.Tensor] = []
    per_layer: list[list[dict[str, Any]]] = [[] for _ in layers]
    originals = [layer.forward for layer in layers]

    def recorder(i: int):
        def forward(*args: Any, **kw: Any) -> Any:
            h = args[0] if args else kw.pop("hidden_states")
            if i == 0:
                hidden.append(h)
            per_layer[i].append({k: v for k, v in kw.items()
                                 if k not in ("past_key_values", "use_cache", "hidden_states")})
            if i == len(layers) - 1:
                raise _StopForward
            return h
        return forward

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        for ids in samples:
            try:
                model.base_model(input_ids=ids, use_cache=False)
            except _StopForward:
                pass
    finally:
        for layer, forward in zip(layers, originals):
            layer.forward = forward
    return LayerInputs(hidden, per_layer[0]), per_layer


def _install_quantized(layer: nn.Module, result: LayerResult) -> list:
    """Dequantized weights into the layer; W8A8 linears also quantize their inputs per token.
    Returns the hook handles to remove."""
    handles = []
    for name, qw in result.items():
        lin = linear(layer, name)
        lin.weight.data = qw.dequantize().to(lin.weight.dtype)
        if isinstance(qw, Int8ChannelWeight):
            handles.append(lin.register_forward_pre_hook(
                lambda _m, args: (fake_quantize_act_per_token(args[0]),)))
    return handles


def check_shapes(cfg: QuantizeConfig, layer: nn.Module) -> None:
    check_layer_layout(layer)
    if cfg.group_size == -1:
        return
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % cfg.group_size:
            raise ValueError(f"--group_size {cfg.group_size} does not divide the input features "
                             f"({module.in_features}) of {name}")


def _layer_tensors(layer: nn.Module, prefix: str, result: LayerResult,
                   dtype: torch.dtype, moe_block: str = "mlp") -> dict[str, torch.Tensor]:
    from bladellm.quantization.algorithms.writer import pack_gptq, pack_int8

    out = {}
    for name, tensor in layer.state_dict().items():
        module_name = name.rsplit(".", 1)[0]
        if module_name in result and name.endswith(".weight"):
            continue
        out[prefix + name] = tensor.to(dtype)
    for name, qw in result.items():
        packed = pack_int8(qw, dtype) if isinstance(qw, Int8ChannelWeight) else pack_gptq(qw)
        out.update({f"{prefix}{name}.{k}": v for k, v in packed.items()})
    return {checkpoint_name(name, moe_block): t for name, t in out.items()}


def quantize_checkpoint(cfg: QuantizeConfig, *, progress: bool = True,
                        algorithm: LayerAlgorithm | None = None) -> QuantizeReport:
    """Quantize ``cfg.model`` into ``cfg.output_dir``; ``algorithm`` overrides the one
    ``cfg.quant_algo`` names (the tests' ablations)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from bladellm.quantization.algorithms import writer
    from bladellm.quantization.calib import load_calibration_texts, tokenize_calibration

    start = time.perf_counter()
    model_dir = os.path.expanduser(cfg.model)
    texts = load_calibration_texts(cfg.calib_data) if cfg.calib_data else None
    algo = algorithm or make_algorithm(cfg)
    samples = None
    if algo.needs_calibration:  # before the model is read: a bad tokenizer fails at once
        try:
            # never the directory's own code (and transformers would ask on stdin)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except (OSError, ValueError) as e:  # transformers' messages run over several lines
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--model: cannot load the tokenizer of {cfg.model} (it tokenizes "
                             f"--calib_data): {first}") from e
        samples = tokenize_calibration(tokenizer, texts, cfg.calib_data_max_len,
                                       cfg.num_calib_samples)
        if len(samples) < cfg.num_calib_samples:  # the text ran out: say so, as asked for more
            logger.warning("--calib_data gives %d calibration sample(s) of the %d asked for "
                           "(--num_calib_samples) at --calib_data_max_len %d: %d tokens",
                           len(samples), cfg.num_calib_samples, cfg.calib_data_max_len,
                           sum(s.shape[1] for s in samples))
    source = ModelSource(model_dir, cfg.cpu_offload)
    moe_arch = moe_architecture(list(getattr(source.config, "architectures", None) or []))
    moe_block, expert_names = MOE_ARCHITECTURES[moe_arch] if moe_arch else ("mlp", None)
    if moe_arch and cfg.cpu_offload:
        raise ValueError(f"--cpu_offload: not supported for {moe_arch} (its experts are read "
                         f"stacked by transformers)")
    expert_tokens: dict[str, list[int]] = {}
    uncalibrated: list[str] = []
    rule = getattr(algo, "uncalibrated_rule", UNCALIBRATED_RULE)
    dtype = source.source_dtype()
    num_layers = len(source.layers)
    inputs = None
    if samples is not None:
        inputs, layer_kwargs = capture_layer_inputs(source.model, samples)
    os.makedirs(cfg.output_dir, exist_ok=True)
    out = writer.ShardedWriter(cfg.output_dir, num_layers + 1)
    for i in tqdm(range(num_layers), desc=f"{cfg.quant_algo} layers", disable=not progress):
        layer = source.load_layer(i)
        if expert_names is not None:
            unfuse_experts(layer, expert_names)
        check_shapes(cfg, layer)
        result = algo.quantize_layer(layer, inputs)
        counts = (expert_token_counts(layer, getattr(algo, "tokens_seen", {}))
                  if inputs is not None else None)
        if counts is not None:
            where = f"{source.layer_prefix}{i}.{moe_block}.experts"
            expert_tokens[where] = counts
            missed = [f"{where}.{e}" for e, n in enumerate(counts) if n == 0]
            uncalibrated += missed
            logger.info("layer %d: calibration tokens per expert %s", i, counts)
            if missed:
                logger.warning("%s: no calibration token reached them; quantized by %s",
                               ", ".join(missed), rule)
        if inputs is not None and i + 1 < num_layers:  # the next layer sees this one quantized
            handles = _install_quantized(layer, result)
            inputs = LayerInputs(run_layer(layer, inputs), layer_kwargs[i + 1])
            for h in handles:
                h.remove()
        out.write_shard(_layer_tensors(layer, f"{source.layer_prefix}{i}.", result, dtype,
                                       moe_block))
        del result
        source.release_layer(i)
    out.write_shard(source.non_layer_tensors())
    choices = {k: getattr(algo, k) for k in ("chosen_ratios", "chosen_alphas")
               if hasattr(algo, k)}
    moe_meta = ({"uncalibrated_experts": uncalibrated,
                 "uncalibrated_experts_rule": rule} if expert_tokens else {})
    _write_config(cfg, model_dir, dtype, inputs, {**choices, **moe_meta})
    writer.copy_side_files(model_dir, cfg.output_dir)
    out.finish()
    return QuantizeReport(
        cfg.output_dir, num_layers, len(inputs.hidden) if inputs else 0,
        inputs.num_tokens if inputs else 0, time.perf_counter() - start, out.total_bytes,
        choices, expert_tokens, uncalibrated)


def _write_config(cfg: QuantizeConfig, model_dir: str, dtype: torch.dtype,
                  inputs: LayerInputs | None, choices: dict[str, Any]) -> None:
    from bladellm.quantization.algorithms import writer

    meta: dict[str, Any] = {
        "quantizer": [f"{TOOL_NAME}:{TOOL_VERSION}"], "quant_algo": cfg.quant_algo,
        "num_calib_samples": len(inputs.hidden) if inputs else 0,
        "calib_data_max_len": cfg.calib_data_max_len if inputs else None,
    }
    if cfg.quant_algo == "smoothquant":
        meta["alpha"] = cfg.smooth_alpha
        qcfg = writer.w8a8_quantization_config(meta)
    else:
        if cfg.quant_algo == "gptq":
            meta["damp_percent"] = cfg.damp_percent
        if cfg.quant_algo == "awq":
            meta["awq_clip"] = cfg.awq_clip
        meta.update(choices)
        qcfg = writer.gptq_quantization_config(cfg.bit, cfg.group_size, cfg.sym, cfg.act_order,
                                               cfg.damp_percent, meta)
    writer.write_config(model_dir, cfg.output_dir, qcfg, str(dtype).removeprefix("torch."))
