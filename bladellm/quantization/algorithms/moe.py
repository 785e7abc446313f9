"""Mixture-of-experts decoder layers in ``blade_llm_quantize`` (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers keeps a layer's experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``), so no hook sees one expert's inputs. ``unfuse_experts`` replaces that
module by ``PerExpertMLPs``: one ``nn.Linear`` per expert projection under the checkpoint's own
names (``mlp.experts.{e}.gate_proj`` / Mixtral's ``w1``), computing what transformers' loop
computes. Its ``expert_names`` give the layer's layout (layouts.py ``moe_layout``, found by
``layout_of_layer`` as every family's is). Each expert's linears then see exactly the tokens routed to it, so GPTQ's Hessians
are per expert, and the checkpoint is written per expert as AutoGPTQ / GPTQModel write it.

Calibration coverage: every calibration token that reaches an expert is counted (the tokens
its gate projection saw in the pass that collected its Hessian), reported per layer and expert.
An expert no calibration token reached has no Hessian; its weights are quantized by min-max
round-to-nearest (``rtn_quantize``: the ``minmax`` algorithm's rule) and listed by name in the
log, the report and ``quantization_config.meta.uncalibrated_experts``.

The router (``mlp.gate``) and Qwen2-MoE's ``shared_expert_gate`` stay float (as AutoGPTQ /
GPTQModel leave them, and as the engine serves them); the shared expert is quantized as a
dense MLP. AWQ, SmoothQuant and SmoothQuant+ fold their input scales into the norm before the block and
compensate the router exactly (layouts.moe_layout); an uncalibrated expert's rule is then
``UNCALIBRATED_RULE_SMOOTHED`` (AWQ, SmoothQuant+) or ``UNCALIBRATED_RULE_W8A8``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from bladellm.checkpoint.moe import is_sparse_layer, num_experts

# Architecture -> (checkpoint name of the MoE block in a layer, an expert's gate, up, down).
MOE_ARCHITECTURES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
# What an expert no calibration token reached is quantized with (stated in the config's meta).
UNCALIBRATED_RULE = "minmax round-to-nearest (no calibration token reached the expert)"
# AWQ: the norm's scales are shared by the whole block, so such an expert's gate / up carry them.
UNCALIBRATED_RULE_SMOOTHED = ("minmax round-to-nearest (no calibration token reached the "
                              "expert): no clipping, up -> down scales of 1; its gate / up "
                              "carry the block's shared input scales folded into the norm")
# SmoothQuant W8A8: weights need no calibration (int8 per-channel min-max, as every expert's).
UNCALIBRATED_RULE_W8A8 = ("int8 per-channel min-max, as every expert (no calibration token "
                          "reached the expert); its gate / up carry the block's shared "
                          "smoothing scales folded into the norm")


def moe_architecture(architectures: list[str]) -> str | None:
    return next((a for a in architectures if a in MOE_ARCHITECTURES), None)


class ExpertMLP(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        for name, w in zip(names, (gate, up, down)):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            lin.weight.data = w.clone()
            self.add_module(name, lin)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]


class PerExpertMLPs(nn.Module):
    """Drop-in for transformers' stacked experts module: ``forward(hidden [T, H], top_k_index
    [T, k], top_k_weights [T, k])``, one ``ExpertMLP`` child per expert (named ``"0"``, ...)."""

    def __init__(self, stacked: nn.Module, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate_up, down = stacked.gate_up_proj.data, stacked.down_proj.data
        self.num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
        self.act_fn = stacked.act_fn
        for e in range(self.num_experts):
            self.add_module(str(e), ExpertMLP(gate_up[e, :inter], gate_up[e, inter:], down[e],
                                              names))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:  # the expert's linears are not called: no tokens seen
                continue
            gate, up, down = getattr(self, str(e)).projections()
            x = hidden_states[token]
            y = down(self.act_fn(gate(x)) * up(x)) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    @property
    def expert_names(self) -> tuple[tuple[str, str, str], ...]:
        """Each expert's (gate, up, down) module names, for layouts.py ``moe_layout``."""
        return tuple(getattr(self, str(e)).names for e in range(self.num_experts))


def unfuse_experts(layer: nn.Module, names: tuple[str, str, str]) -> PerExpertMLPs | None:
    """Replace ``layer.mlp.experts`` (stacked) by ``PerExpertMLPs``; None for a dense layer
    (Qwen2-MoE's ``mlp_only_layers``)."""
    mlp = getattr(layer, "mlp", None)
    stacked = getattr(mlp, "experts", None)
    if stacked is None:
        return None
    if isinstance(stacked, PerExpertMLPs):
        return stacked
    if not isinstance(getattr(stacked, "gate_up_proj", None), torch.Tensor):
        raise ValueError(f"--model: {type(stacked).__name__} does not hold its experts stacked "
                         f"as transformers does (gate_up_proj / down_proj)")
    experts = PerExpertMLPs(stacked, names)
    mlp.experts = experts
    return experts


def expert_token_counts(layer: nn.Module, tokens_seen: dict[str, int]) -> list[int] | None:
    """Per expert of ``layer``, the calibration tokens its gate projection saw (from the
    algorithm's ``tokens_seen``); None for a dense layer."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if not isinstance(experts, PerExpertMLPs):
        return None
    return [tokens_seen.get(f"mlp.experts.{e}.{getattr(experts, str(e)).names[0]}", 0)
            for e in range(experts.num_experts)]


def checkpoint_name(name: str, block: str) -> str:
    """A tensor name of our layer (``model.layers.0.mlp.experts.0.w1.qweight``) as the
    architecture's checkpoints spell it (Mixtral: ``block_sparse_moe``)."""
    return name.replace(".mlp.", f".{block}.", 1) if block != "mlp" else name


def required_mlp_tensors(raw: dict[str, Any], arch: str, layer: int) -> list[str]:
    """The MLP tensors (relative to the layer) a float checkpoint of ``arch`` must hold."""
    block, names = MOE_ARCHITECTURES[arch]
    config = SimpleNamespace(**raw)
    if num_experts(config) == 0:  # transformers would build its default experts at random
        raise ValueError(f"--model: config.json of this {arch} names no experts "
                         f"(num_local_experts / num_experts)")
    if not is_sparse_layer(config, layer):
        return [f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return [f"{block}.gate.weight"] + [f"{block}.experts.{e}.{n}.weight"
                                       for e in range(num_experts(config)) for n in names]


__all__ = ["MOE_ARCHITECTURES", "PerExpertMLPs", "UNCALIBRATED_RULE",
           "UNCALIBRATED_RULE_SMOOTHED", "UNCALIBRATED_RULE_W8A8", "checkpoint_name",
           "expert_token_counts", "moe_architecture", "required_mlp_tensors",
           "unfuse_experts"]
