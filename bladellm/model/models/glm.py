"""GLM (``GlmForCausalLM``) and GLM-4 (``Glm4ForCausalLM``) as in transformers: the Llama
layout with q/k/v biases, rotary on half of each head in the interleaved (GPT-J) layout, and
checkpoints that fuse ``gate_up_proj``; GLM-4 adds a norm after attention and after the MLP.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers import RMSNorm
from bladellm.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from bladellm.model.utils import unfuse_checkpoint


class GlmForCausalLM(LlamaForCausalLM):
    rope_interleaved = True  # rotary pairs dims (2i, 2i + 1), not (i, i + d / 2)

    def attention_biases(self, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "attention_bias", True)), False

    def fused_checkpoint_modules(self) -> dict[str, list[tuple[str, int]]]:
        """Checkpoint tensors that fuse modules, with the rows of each part."""
        inter = self.hf_config.intermediate_size
        return {"gate_up_proj": [("gate_proj", inter), ("up_proj", inter)]}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(unfuse_checkpoint(weights, self.fused_checkpoint_modules(),
                                                      dict(self.named_parameters())))


class Glm4DecoderLayer(LlamaDecoderLayer):
    """GLM-4's sandwich: norms after attention and after the MLP, before each residual add."""

    def __init__(self, self_attn: Any, hf_config: Any, dtype: torch.dtype, quant_config: Any,
                 prefix: str, *args: Any) -> None:
        # *args: whatever else LlamaModel hands its layers (an MLP of the model's own).
        super().__init__(self_attn, hf_config, dtype, quant_config, prefix, *args)
        eps = hf_config.rms_norm_eps
        self.post_self_attn_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=dtype)
        self.post_mlp_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype=dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, ctx))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden, ctx)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    decoder_layer_cls = Glm4DecoderLayer


__all__ = ["Glm4ForCausalLM", "GlmForCausalLM"]
