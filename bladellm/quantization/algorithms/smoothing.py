"""Per-input-channel scales migrated between a layer's operations (SmoothQuant, AWQ, SQ+).

A ``SmoothGroup`` is an operation ``prev`` (an RMSNorm or a linear) whose output feeds the
``linears``. Scaling input channel ``j`` of every linear by ``s_j`` and dividing channel ``j`` of
``prev``'s output by ``s_j`` leaves the float layer unchanged, and moves quantization difficulty
between activations and weights. ``inspect`` names the submodule whose output measures a
candidate's error (attention for q/k/v, the MLP for gate/up, the linear itself otherwise).
Modules in ``float_linears`` (a MoE router) read ``prev``'s output but stay float: they take the
same scales on their weight columns, so they compute what they did; the search leaves them (and
``prev``) alone, so routing is the float layer's for every candidate.
"""

from __future__ import annotations

import torch
from torch import nn

from bladellm.quantization.algorithms.layer_io import (LayerInputs, call_submodule,
                                                        capture_inputs, input_hooks, linear,
                                                        run_layer)
from bladellm.quantization.algorithms.layouts import LLAMA, SmoothGroup
from bladellm.quantization.algorithms.quantizer import GroupQuantSpec, fake_quantize_groups

__all__ = ["SmoothGroup", "ATTN_IN", "ATTN_OUT", "MLP_IN", "MLP_OUT"]

# The Llama family's groups (each family's: its ``LayerLayout``).
ATTN_IN, ATTN_OUT, MLP_IN, MLP_OUT = LLAMA.attn_in, LLAMA.attn_out, LLAMA.mlp_in, LLAMA.mlp_out


def applicable_groups(layer: nn.Module,
                      groups: tuple[SmoothGroup | None, ...]) -> list[SmoothGroup]:
    """Drop the groups the layout has none of (None), and a linear -> linear group whose
    channels do not line up one to one (grouped-query attention repeats v's heads), as AutoAWQ
    does."""
    keep = []
    for g in groups:
        if g is None:
            continue
        prev = layer.get_submodule(g.prev)
        if isinstance(prev, nn.Linear) and prev.out_features != \
                linear(layer, g.linears[0]).in_features:
            continue
        keep.append(g)
    return keep


@torch.no_grad()
def apply_scales(layer: nn.Module, group: SmoothGroup, scales: torch.Tensor) -> None:
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        prev.weight.data.div_(scales.unsqueeze(1))
        if prev.bias is not None:
            prev.bias.data.div_(scales)
    elif group.unit_offset:  # Gemma's RMSNorm: y = (1 + w) * x / rms(x)
        prev.weight.data = (1 + prev.weight.data) / scales - 1
    else:  # RMSNorm: y = w * x / rms(x); LayerNorm: y = w * norm(x) + b
        prev.weight.data.div_(scales)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(scales)
    for n in group.linears:
        linear(layer, n).weight.data.mul_(scales.unsqueeze(0))
    for n in group.float_linears:  # routers: not nn.Linear in transformers, but [out, in] weights
        layer.get_submodule(n).weight.data.mul_(scales.unsqueeze(0))


def input_absmax(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.reshape(-1, x.shape[-1]).abs().amax(0) for x in xs]).amax(0).float()


def input_absmean(xs: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).float()
    return flat.abs().mean(0)


def weight_absmax(layer: nn.Module, group: SmoothGroup) -> torch.Tensor:
    ws = torch.cat([linear(layer, n).weight.data for n in group.linears])
    return ws.abs().amax(0).float()


@torch.no_grad()
def search_scales(layer: nn.Module, group: SmoothGroup, inputs: LayerInputs,
                  xs: list[torch.Tensor], candidates: list[torch.Tensor],
                  spec: GroupQuantSpec) -> tuple[int, list[float]]:
    """Index of the candidate scales whose weight fake-quantization (``Q(W*s)/s``) gives the
    smallest mean squared error of ``group.inspect``'s output against the float layer, and
    the error of every candidate. The layer is left as it was."""
    lins = [linear(layer, n) for n in group.linears]
    originals = [lin.weight.data.clone() for lin in lins]
    reference = [call_submodule(layer, group.inspect, x, kw) for x, kw in zip(xs, inputs.kwargs)]
    losses = []
    for s in candidates:
        for lin, w in zip(lins, originals):
            lin.weight.data = fake_quantize_groups(w * s, spec) / s
        err = sum(float((call_submodule(layer, group.inspect, x, kw) - ref).pow(2).sum())
                  for x, kw, ref in zip(xs, inputs.kwargs, reference))
        losses.append(err / sum(r.numel() for r in reference))
    for lin, w in zip(lins, originals):
        lin.weight.data = w
    best = min(range(len(losses)), key=losses.__getitem__)
    return best, losses


def group_inputs(layer: nn.Module, group: SmoothGroup,
                 inputs: LayerInputs) -> list[torch.Tensor]:
    """Inputs of the group's linears (they share one; ``group.inp``'s where named) with the
    layer as it is now. A MoE expert's linear is called only on the samples routing sent it
    tokens: fewer entries than samples, none for an expert no token reached."""
    name = group.inp or group.linears[0]
    return capture_inputs(layer, inputs, (name,))[name]


@torch.no_grad()
def count_tokens(layer: nn.Module, inputs: LayerInputs, names: tuple[str, ...]) -> dict[str, int]:
    """The calibration tokens each named linear sees in one pass of the layer (a MoE expert's:
    those routed to it; the scales fold exactly, so routing is the float layer's)."""
    seen = dict.fromkeys(names, 0)

    def add(n: str, x: torch.Tensor) -> None:
        seen[n] += x.reshape(-1, x.shape[-1]).shape[0]

    with input_hooks(layer, names, add):
        run_layer(layer, inputs)
    return seen


def expert_tokens_seen(layer: nn.Module, layout, inputs: LayerInputs) -> dict[str, int]:
    """For a MoE layer (``layout.expert_out``), the tokens each gate / up projection saw (what
    the pipeline counts per expert); empty for a dense layer."""
    return count_tokens(layer, inputs, layout.sequential[2]) if layout.expert_out else {}
