"""Mixtral: the Llama/Mistral layout with a mixture-of-experts MLP in every layer
(``block_sparse_moe``: a router over ``num_local_experts`` experts, top-k renormalised)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from bladellm.model.layers.fused_moe import ExpertWeights, build_sparse_moe_block
from bladellm.model.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int, prefix: str) -> nn.Module | None:
        cfg = self.hf_config
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; only silu is supported")
        return build_sparse_moe_block(
            cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
            cfg.intermediate_size, renormalize=True, dtype=self.dtype,
            quant_config=self.quant_config, prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = ExpertWeights(self)

        def renamed(items: Iterable[tuple[str, Any]]):
            for name, tensor in items:  # the checkpoint's MoE block is our decoder layer's mlp
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor

        return super().load_weights(experts.route(renamed(weights))) | experts.loaded()


__all__ = ["MixtralForCausalLM"]
