"""ChatGLM2 / ChatGLM3 / original GLM-4 checkpoints (``model_type: chatglm``, architectures
``ChatGLMModel`` / ``ChatGLMForConditionalGeneration``) read without running their custom code:
config.json becomes a plain ``PretrainedConfig`` holding its own fields plus the standard names
the engine reads (``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``). The
model (``model/models/chatglm.py``) builds our GLM from those fields."""

from __future__ import annotations

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
