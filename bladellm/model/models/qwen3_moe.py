"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, explicit head_dim) with Qwen2-MoE's
layer rule (``decoder_sparse_step``, ``mlp_only_layers``) and no shared expert; the top-k
weights are renormalised where ``norm_topk_prob``."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from bladellm.checkpoint.moe import is_sparse_layer
from bladellm.model.layers.fused_moe import ExpertWeights, build_sparse_moe_block
from bladellm.model.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer: int, prefix: str) -> nn.Module | None:
        cfg = self.hf_config
        if not is_sparse_layer(cfg, layer):
            return None
        return build_sparse_moe_block(
            cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob), dtype=self.dtype,
            quant_config=self.quant_config, prefix=prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = ExpertWeights(self)
        return super().load_weights(experts.route(weights)) | experts.loaded()


__all__ = ["Qwen3MoeForCausalLM"]
