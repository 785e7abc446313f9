"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama layout with ``qkv_proj`` and
``gate_up_proj`` fused in the checkpoint, LongRoPE (``longrope`` / ``su``) and partial rotary
through the shared rotary layer."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from bladellm.model.models.llama import LlamaForCausalLM
from bladellm.model.utils import unfuse_checkpoint


class Phi3ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, hf_config: Any) -> tuple[bool, bool]:
        return False, False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        cfg = self.hf_config
        q = cfg.num_attention_heads * self.head_dim
        kv = cfg.num_key_value_heads * self.head_dim
        inter = cfg.intermediate_size
        fused = {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                 "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)]}
        return super().load_weights(unfuse_checkpoint(weights, fused,
                                                      dict(self.named_parameters())))


__all__ = ["Phi3ForCausalLM"]
