"""AWQ (Lin et al., 2023), as llm-awq does it.

Per group of linears sharing an input: scales ``s = mean|x|^a`` (normalized by
``sqrt(max(s) * min(s))``) for ``a`` on a grid of 20 values in [0, 1), the one whose fake-quantized
weights ``Q(W*s)/s`` give the smallest output error of the block is folded into the previous
RMSNorm / linear (``a = 0`` is plain round to nearest, so the search never loses to it on the
calibration data). Then, per linear except q/k (whose errors the softmax hides, llm-awq skips
them), a clipping search shrinks each group's range to ``max|w| * (1 - i/20)``, i < 10, keeping
the value with the smallest output error on up to 512 calibration tokens. Last, round to
nearest on the group grid.

Mixture-of-experts layers (layouts.moe_layout; AutoAWQ's mixtral / qwen3_moe grouping): one
scale vector for the norm before the block, shared by every expert's gate / up (and the shared
expert's), searched on the error of the whole block's output (routing included) over all
calibration tokens; the float router and ``shared_expert_gate`` take the scales on their weight
columns, so they route as before (AutoAWQ leaves the router out of the group, and so feeds it
the divided norm output). Then each expert's up -> down, searched on that expert's routed tokens,
and clipping per expert linear on its own tokens. An expert no calibration token reached keeps
up -> down scales of 1 and gets no clipping: min-max round-to-nearest of its weights (its gate /
up carrying the block's shared scales, as the fold requires), named by the pipeline.
"""

from __future__ import annotations

import torch
from torch import nn

from bladellm.quantization.algorithms.base import LayerResult
from bladellm.quantization.algorithms.layer_io import LayerInputs, capture_inputs, linear
from bladellm.quantization.algorithms.layouts import layout_of_layer
from bladellm.quantization.algorithms.moe import UNCALIBRATED_RULE_SMOOTHED
from bladellm.quantization.algorithms.quantizer import (GroupQuantSpec, fake_quantize_groups,
                                                         rtn_quantize)
from bladellm.quantization.algorithms.smoothing import (applicable_groups, apply_scales,
                                                         expert_tokens_seen, group_inputs,
                                                         input_absmean, search_scales)

N_GRID = 20
MAX_SHRINK = 0.5
CLIP_TOKENS = 512


def awq_candidates(x_mean: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for i in range(N_GRID):
        s = x_mean.pow(i / N_GRID).clamp(min=1e-4)
        out.append(s / (s.max() * s.min()).sqrt())
    return out


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, spec: GroupQuantSpec,
                oc_batch: int = 256) -> torch.Tensor:
    """Per (output channel, group) the clipping bound ``[out, groups]`` minimizing the error of
    ``x @ Q(clamp(w)).T`` per group (llm-awq ``auto_clip_layer``)."""
    out_f, in_f = w.shape
    gs = spec.effective_group_size(in_f)
    groups = in_f // gs
    x = x.reshape(-1, in_f).float()
    x = x[::max(1, x.shape[0] // CLIP_TOKENS)][:CLIP_TOKENS]
    xg = x.reshape(-1, groups, gs).permute(1, 2, 0)  # [groups, gs, tokens]
    best = []
    for o in range(0, out_f, oc_batch):
        wb = w[o:o + oc_batch].float().reshape(-1, groups, gs).permute(1, 0, 2)  # [g, oc, gs]
        org_max = wb.abs().amax(-1, keepdim=True)
        ref = torch.bmm(wb, xg)  # [g, oc, tokens]
        best_max = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        for i in range(int(MAX_SHRINK * N_GRID)):
            max_val = org_max * (1 - i / N_GRID)
            cur = torch.clamp(wb, -max_val, max_val)
            q = fake_quantize_groups(cur.permute(1, 0, 2).reshape(-1, in_f), spec)
            q = q.reshape(-1, groups, gs).permute(1, 0, 2)
            err = (torch.bmm(q, xg) - ref).pow(2).mean(-1, keepdim=True)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_max = torch.where(better, max_val, best_max)
        best.append(best_max.squeeze(-1).t())  # [oc, g]
    return torch.cat(best)


class AWQ:
    name = "awq"
    needs_calibration = True
    uncalibrated_rule = UNCALIBRATED_RULE_SMOOTHED  # MoE experts no calibration token reached

    def __init__(self, spec: GroupQuantSpec, *, clip: bool = True) -> None:
        self.spec, self.clip = spec, clip
        self.chosen_ratios: list[float] = []  # grid value picked per group, for the record
        #: MoE: calibration tokens each expert linear of the last layer saw (by name in the layer)
        self.tokens_seen: dict[str, int] = {}

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        assert inputs is not None
        layout = layout_of_layer(layer)
        self.tokens_seen = expert_tokens_seen(layer, layout, inputs)
        groups = (layout.attn_in, layout.attn_out, layout.mlp_in, layout.mlp_out,
                  *layout.expert_out)
        for group in applicable_groups(layer, groups):
            xs = group_inputs(layer, group, inputs)
            if not xs:  # an expert no calibration token reached: scales of 1
                continue
            candidates = awq_candidates(input_absmean(xs))
            best, _ = search_scales(layer, group, inputs, xs, candidates, self.spec)
            self.chosen_ratios.append(best / N_GRID)
            apply_scales(layer, group, candidates[best])
        if self.clip:
            names = tuple(n for n in layout.linear_names if n not in layout.clip_skip)
            seen = capture_inputs(layer, inputs, names)
            for n in names:
                if not seen[n]:  # an expert no calibration token reached: no clipping
                    continue
                lin = linear(layer, n)
                bound = search_clip(lin.weight.data, torch.cat(
                    [x.reshape(-1, x.shape[-1]) for x in seen[n]]), self.spec)
                gs = self.spec.effective_group_size(lin.in_features)
                bound = bound.repeat_interleave(gs, dim=1)
                lin.weight.data = torch.clamp(lin.weight.data, -bound, bound)
            del seen
        return {n: rtn_quantize(linear(layer, n).weight.data, self.spec)
                for n in layout.linear_names}
