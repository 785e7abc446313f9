"""SmoothQuant (Xiao et al., 2022) W8A8 and SmoothQuant+ (Pan et al., 2023) 4-bit weight-only.

SmoothQuant: ``s_j = max|X_j|^a / max|W_j|^(1-a)`` (``a`` = ``--alpha``, 0.5 by default) for the
inputs of q/k/v and of gate/up, folded into the RMSNorm before them (llm-compressor's default
Llama mappings); then every linear gets symmetric int8 per-channel weights, and activations are
quantized per token at run time (the written checkpoint says so; the calibration pass here
fake-quantizes them so the next layer sees what a W8A8 engine computes).

SmoothQuant+: the same scales, with ``a`` searched per group over 0, 0.05, ..., 1 to minimize the
block output error under 4-bit group weight quantization, plus the candidate "no smoothing"
(the paper's search ranges over a model-wide ``a``; per group the choice can only be at least
as good on the calibration data, and never worse than plain round to nearest). Also smooths
up -> down, as the paper does for the down projection. Then group round to nearest.

Mixture-of-experts layers (layouts.moe_layout): the norm before the block smooths every expert's
gate / up (and the shared expert's) with one scale vector from the block's input (all tokens),
the float router and ``shared_expert_gate`` taking the same scales on their weight columns (the
fold is exact: routing unchanged); SmoothQuant+ searches it on the block's output, then each
expert's up -> down on that expert's routed tokens. An expert no calibration token reached gets
up -> down scales of 1 (SmoothQuant+); its weights are quantized as every expert's are (min-max:
int8 per channel, or 4-bit round to nearest), its gate / up carrying the block's scales.
"""

from __future__ import annotations

import torch
from torch import nn

from bladellm.quantization.algorithms.base import LayerResult
from bladellm.quantization.algorithms.layer_io import LayerInputs, linear
from bladellm.quantization.algorithms.layouts import layout_of_layer
from bladellm.quantization.algorithms.moe import (UNCALIBRATED_RULE_SMOOTHED,
                                                  UNCALIBRATED_RULE_W8A8)
from bladellm.quantization.algorithms.quantizer import (GroupQuantSpec, int8_channel_quantize,
                                                         rtn_quantize)
from bladellm.quantization.algorithms.smoothing import (SmoothGroup, applicable_groups,
                                                         apply_scales, expert_tokens_seen,
                                                         group_inputs,
                                                         input_absmax, search_scales,
                                                         weight_absmax)

ALPHA_GRID = tuple(i / 20 for i in range(21))


def smooth_scales(act_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    return (act_max.pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


class SmoothQuant:
    name = "smoothquant"
    needs_calibration = True
    uncalibrated_rule = UNCALIBRATED_RULE_W8A8  # MoE experts no calibration token reached

    def __init__(self, alpha: float = 0.5, *, smoothing: bool = True) -> None:
        # smoothing=False is plain W8A8 (the ablation the tests compare against)
        self.alpha, self.smoothing = alpha, smoothing
        #: MoE: calibration tokens each expert linear of the last layer saw (by name in the layer)
        self.tokens_seen: dict[str, int] = {}

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        assert inputs is not None
        layout = layout_of_layer(layer)
        self.tokens_seen = expert_tokens_seen(layer, layout, inputs)
        if self.smoothing:
            for group in applicable_groups(layer, (layout.attn_in, layout.mlp_in)):
                act_max = input_absmax(group_inputs(layer, group, inputs))
                apply_scales(layer, group, smooth_scales(act_max, weight_absmax(layer, group),
                                                         self.alpha))
        return {n: int8_channel_quantize(linear(layer, n).weight.data)
                for n in layout.linear_names}


class SmoothQuantPlus:
    name = "smoothquant+"
    needs_calibration = True
    uncalibrated_rule = UNCALIBRATED_RULE_SMOOTHED  # MoE experts no calibration token reached

    def __init__(self, spec: GroupQuantSpec) -> None:
        self.spec = spec
        self.chosen_alphas: list[float | None] = []  # None: no smoothing won
        #: MoE: calibration tokens each expert linear of the last layer saw (by name in the layer)
        self.tokens_seen: dict[str, int] = {}

    def _smooth(self, layer: nn.Module, group: SmoothGroup, inputs: LayerInputs) -> None:
        xs = group_inputs(layer, group, inputs)
        if not xs:  # an expert no calibration token reached: scales of 1
            return
        act_max, w_max = input_absmax(xs), weight_absmax(layer, group)
        candidates = [torch.ones_like(act_max)] + [smooth_scales(act_max, w_max, a)
                                                   for a in ALPHA_GRID]
        best, _ = search_scales(layer, group, inputs, xs, candidates, self.spec)
        self.chosen_alphas.append(None if best == 0 else ALPHA_GRID[best - 1])
        if best:
            apply_scales(layer, group, candidates[best])

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        assert inputs is not None
        layout = layout_of_layer(layer)
        self.tokens_seen = expert_tokens_seen(layer, layout, inputs)
        for group in applicable_groups(layer, (layout.attn_in, layout.mlp_in, layout.mlp_out,
                                               *layout.expert_out)):
            self._smooth(layer, group, inputs)
        return {n: rtn_quantize(linear(layer, n).weight.data, self.spec)
                for n in layout.linear_names}
