"""Qwen2: the Llama layout with a bias on q/k/v (not on o_proj)."""

from __future__ import annotations

from typing import Any

from bladellm.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_biases(self, hf_config: Any) -> tuple[bool, bool]:
        return True, False


__all__ = ["Qwen2ForCausalLM"]
