"""ChatGLM2 / ChatGLM3 / original GLM-4 checkpoints (``ChatGLMModel`` layout) on our GLM: the
config's ChatGLM fields become GLM's, the checkpoint's names GLM's (fused ``query_key_value``
with bias, multi-query groups, rotary on half of each head in interleaved pairs). No code from
the model directory runs."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Iterable

import torch

from bladellm.attention.backend import AttentionBackend
from bladellm.model.models.glm import GlmForCausalLM

# ChatGLM checkpoint name -> ours (GLM's as transformers names them), by prefix / pattern.
_RENAMES = [
    (re.compile(r"^transformer\.embedding\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.encoder\.final_layernorm\."), "model.norm."),
    (re.compile(r"^transformer\.output_layer\."), "lm_head."),
    (re.compile(r"^transformer\.encoder\.layers\.(\d+)\.self_attention\.query_key_value\."),
     r"model.layers.\1.self_attn.qkv_proj."),
    (re.compile(r"^transformer\.encoder\.layers\.(\d+)\.self_attention\.dense\."),
     r"model.layers.\1.self_attn.o_proj."),
    (re.compile(r"^transformer\.encoder\.layers\.(\d+)\.mlp\.dense_h_to_4h\."),
     r"model.layers.\1.mlp.gate_up_proj."),
    (re.compile(r"^transformer\.encoder\.layers\.(\d+)\.mlp\.dense_4h_to_h\."),
     r"model.layers.\1.mlp.down_proj."),
    (re.compile(r"^transformer\.encoder\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\."),
     r"model.layers.\1.\2."),
]


def glm_config_from_chatglm(cfg: Any) -> SimpleNamespace:
    """GLM's config fields from a ChatGLM config (ours, ``checkpoint/chatglm.py``, or the one
    its custom code builds). Variants the layout does not cover are one-line errors naming
    the field."""
    def field(name: str, default: Any = None) -> Any:
        return getattr(cfg, name, default)

    refused = [("rmsnorm", False, "LayerNorm blocks"), ("add_bias_linear", True, "biases on "
               "the dense layers"), ("apply_residual_connection_post_layernorm", True,
               "residuals taken after the norm"), ("post_layer_norm", False, "no final norm")]
    for name, bad, what in refused:
        if bool(field(name, not bad)) == bad:
            raise ValueError(f"ChatGLM config {name}={bad} ({what}) is not supported")
    if field("quantization_bit", 0):
        raise ValueError(f"ChatGLM config quantization_bit={field('quantization_bit')}: the "
                         f"checkpoint's own int4/int8 format is not supported; serve the "
                         f"unquantized checkpoint (or a GPTQ / AWQ one)")
    if field("pre_seq_len"):
        raise ValueError(f"ChatGLM config pre_seq_len={field('pre_seq_len')}: P-tuning v2 "
                         f"prefixes are not supported")
    heads = cfg.num_attention_heads
    kv_heads = field("multi_query_group_num", heads) if field("multi_query_attention") else heads
    head_dim = field("kv_channels") or cfg.hidden_size // heads
    return SimpleNamespace(
        architectures=list(field("architectures", None) or ["ChatGLMModel"]),
        vocab_size=field("padded_vocab_size") or cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=field("num_layers") or cfg.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_act="silu", rms_norm_eps=field("layernorm_epsilon", 1e-5),
        attention_bias=bool(field("add_qkv_bias", False)), mlp_bias=False,
        max_position_embeddings=field("seq_length") or cfg.max_position_embeddings,
        rope_theta=10000.0 * float(field("rope_ratio", 1.0) or 1.0), partial_rotary_factor=0.5,
        tie_word_embeddings=bool(field("tie_word_embeddings", False)))


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
        def renamed(items: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in items:
                if name.endswith("rotary_pos_emb.inv_freq"):
                    continue
                for pattern, repl in _RENAMES:
                    new, n = pattern.subn(repl, name)
                    if n:
                        name = new
                        break
                yield name, tensor

        return super().load_weights(renamed(weights))


__all__ = ["ChatGLMForCausalLM", "glm_config_from_chatglm"]
