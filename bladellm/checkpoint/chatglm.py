"""ChatGLM2 / ChatGLM3 / original GLM-4 checkpoints (``model_type: chatglm``, architectures
``ChatGLMModel`` / ``ChatGLMForConditionalGeneration``) read without running their custom code:
config.json becomes a plain ``PretrainedConfig`` holding its own fields plus the standard names
the engine reads (``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``). The
model (``model/models/chatglm.py``) builds our GLM from those fields."""

from __future__ import annotations

import re
from typing import Any

CHATGLM_ARCHITECTURES = ("ChatGLMModel", "ChatGLMForConditionalGeneration")


def is_chatglm(raw: dict[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return raw.get("model_type") == "chatglm" or any(a in CHATGLM_ARCHITECTURES for a in archs)


def chatglm_config(raw: dict[str, Any], path: str) -> Any:
    """``raw`` (config.json of ``path``) as a ``PretrainedConfig``; missing required fields are
    one-line errors naming them."""
    from transformers import PretrainedConfig

    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "seq_length"):
        if key not in raw:
            raise ValueError(f"{path}: a ChatGLM config needs {key!r}")
    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    fields.setdefault("architectures", ["ChatGLMModel"])
    fields.setdefault("tie_word_embeddings", False)
    config = PretrainedConfig(**fields)
    config.num_hidden_layers = raw["num_layers"]
    config.vocab_size = raw.get("padded_vocab_size", raw.get("vocab_size"))
    config.max_position_embeddings = raw["seq_length"]
    # What parallel_fit checks a tensor-parallel degree against.
    heads = raw["num_attention_heads"]
    config.num_key_value_heads = raw.get("multi_query_group_num", heads) \
        if raw.get("multi_query_attention") else heads
    config.intermediate_size = raw["ffn_hidden_size"]
    return config


# ChatGLM checkpoint name -> GLM's (as transformers names it; ``query_key_value`` stays fused as
# ``qkv_proj``: the engine splits it at load, blade_llm_quantize into q / k / v_proj).
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


def glm_tensor_name(name: str) -> str | None:
    """A ChatGLM checkpoint tensor's GLM name; None for the rotary table (computed, not a
    weight). Names outside the layout come back unchanged (the loader then names them)."""
    if name.endswith("rotary_pos_emb.inv_freq"):
        return None
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


def glm_fields(cfg: Any) -> dict[str, Any]:
    """GLM's config fields (transformers' ``GlmConfig`` keyword arguments, which are also what
    our GLM reads) from a ChatGLM config: config.json's dict, ``chatglm_config``'s object, or
    the one its custom code builds. Variants the layout does not cover are one-line errors
    naming the field."""
    def field(name: str, default: Any = None) -> Any:
        if isinstance(cfg, dict):
            return cfg.get(name, default)
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
    heads = field("num_attention_heads")
    hidden = field("hidden_size")
    kv_heads = field("multi_query_group_num", heads) if field("multi_query_attention") else heads
    return dict(
        vocab_size=field("padded_vocab_size") or field("vocab_size"),
        hidden_size=hidden, intermediate_size=field("ffn_hidden_size"),
        num_hidden_layers=field("num_layers") or field("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=field("kv_channels") or hidden // heads,
        hidden_act="silu", rms_norm_eps=field("layernorm_epsilon", 1e-5),
        attention_bias=bool(field("add_qkv_bias", False)),
        max_position_embeddings=field("seq_length") or field("max_position_embeddings"),
        rope_theta=10000.0 * float(field("rope_ratio", 1.0) or 1.0), partial_rotary_factor=0.5,
        tie_word_embeddings=bool(field("tie_word_embeddings", False)),
        **{k: field(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if field(k) is not None})
