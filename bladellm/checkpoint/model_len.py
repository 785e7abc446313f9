"""The one rule for a model's context length (``--max_model_len`` against the config)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Where configs keep the context length, in order of preference.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length", "n_ctx")

# When the config states no context length at all (rare; some remote-code models).
_FALLBACK_MAX_MODEL_LEN = 2048



def get_text_attr(hf_config, keys: tuple[str, ...]):
    """First of ``keys`` set on the config or, for multimodal configs, on its text_config."""
    if hf_config is None:
        return None
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is None:
            continue
        for key in keys:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def resolve_max_model_len(hf_config, override: int | None) -> int:
    derived = get_text_attr(hf_config, _MAX_LEN_KEYS)
    if override is None:
        if derived is None:
            logger.warning("config states no context length; using max_model_len=%d",
                           _FALLBACK_MAX_MODEL_LEN)
            return _FALLBACK_MAX_MODEL_LEN
        return derived
    if override <= 0:
        raise ValueError(f"--max_model_len: must be positive, got {override}")
    if derived is not None and override > derived:
        raise ValueError(f"--max_model_len: {override} exceeds the model's context length "
                         f"({derived}, max_position_embeddings in config.json)")
    return override
