"""ChatGLM2 / ChatGLM3 / original GLM-4 checkpoints (``ChatGLMModel`` layout) on our GLM: the
config's ChatGLM fields become GLM's, the checkpoint's names GLM's (fused ``query_key_value``
with bias, multi-query groups, rotary on half of each head in interleaved pairs). No code from
the model directory runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch

from bladellm.attention.backend import AttentionBackend
from bladellm.checkpoint.chatglm import glm_fields, glm_tensor_name
from bladellm.model.models.glm import GlmForCausalLM


def glm_config_from_chatglm(cfg: Any) -> SimpleNamespace:
    """GLM's config fields from a ChatGLM config (``checkpoint/chatglm.py`` maps them: the same
    mapping blade_llm_quantize builds transformers' GlmForCausalLM with)."""
    return SimpleNamespace(architectures=list(getattr(cfg, "architectures", None)
                                              or ["ChatGLMModel"]),
                           mlp_bias=False, **glm_fields(cfg))


class ChatGLMForCausalLM(GlmForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, attn_backend: AttentionBackend,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(glm_config_from_chatglm(hf_config), dtype, attn_backend, quant_config,
                         prefix)

    def fused_checkpoint_modules(self) -> dict[str, list[tuple[str, int]]]:
        cfg = self.hf_config
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        return {**super().fused_checkpoint_modules(),
                "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((glm_tensor_name(name), tensor) for name, tensor in weights)
        return super().load_weights(
            (name, tensor) for name, tensor in renamed if name is not None)


__all__ = ["ChatGLMForCausalLM", "glm_config_from_chatglm"]
