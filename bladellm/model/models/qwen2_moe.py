"""Qwen2-MoE: the Qwen2 layout (q/k/v biases where ``qkv_bias``) with mixture-of-experts MLPs: every
``decoder_sparse_step``-th layer not in ``mlp_only_layers`` routes each token to
``num_experts_per_tok`` of ``num_experts`` experts (renormalised where ``norm_topk_prob``) and
adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``; the other layers keep a
dense MLP of ``intermediate_size``."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from bladellm.checkpoint.moe import is_sparse_layer
from bladellm.model.layers.fused_moe import ExpertWeights, build_sparse_moe_block
from bladellm.model.models.llama import LlamaMLP
from bladellm.model.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def attention_biases(self, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False

    def make_mlp(self, layer: int, prefix: str) -> nn.Module | None:
        cfg = self.hf_config
        if not is_sparse_layer(cfg, layer):
            return None
        shared = None
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            shared = LlamaMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                              cfg.hidden_act, False, self.dtype, self.quant_config,
                              f"{prefix}.shared_expert")
        return build_sparse_moe_block(
            cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob), dtype=self.dtype,
            quant_config=self.quant_config, prefix=prefix, shared_expert=shared,
            shared_expert_gate=shared is not None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = ExpertWeights(self)
        return super().load_weights(experts.route(weights)) | experts.loaded()


__all__ = ["Qwen2MoeForCausalLM"]
