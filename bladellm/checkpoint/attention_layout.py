"""Which decoder layers attend within a sliding window, read from config.json as transformers
reads it (torch-free: the engine core sizes the KV manager from it before any weight loads)."""

from __future__ import annotations

from typing import Any


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's ``full_attention`` / ``sliding_attention``: ``layer_types`` where given;
    else Qwen2's ``use_sliding_window`` with ``max_window_layers`` (layers from that index on
    slide), Gemma's ``sliding_window_pattern`` (every n-th layer global), or a
    ``sliding_window`` on every layer (Mistral)."""
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                             f"{n} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"config.json: unsupported layer_types {sorted(unknown)}; "
                             f"supported: full_attention, sliding_attention")
        return list(types)
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return ["full_attention"] * n
    pattern = getattr(hf_config, "sliding_window_pattern", None)
    if pattern:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(n)]
    first = getattr(hf_config, "max_window_layers", 0) \
        if hasattr(hf_config, "use_sliding_window") else 0
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def layer_sliding_window(hf_config: Any, layer: int) -> int | None:
    """The window of (global) decoder layer ``layer``; None for a global one, or for a window
    no shorter than the model's context (``max_position_embeddings``, which bounds
    ``--max_model_len``): that is exact full attention, which keeps the plain kernels (and the
    compiled decoder stack)."""
    if layer_types(hf_config)[layer] != "sliding_attention":
        return None
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: layer {layer} slides but sliding_window is "
                         f"{window!r}")
    limit = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(limit, int) and window >= limit:
        return None
    return window


def layer_windows(hf_config: Any) -> list[int | None]:
    """Each decoder layer's window (None: global), of a VLM's language model too."""
    hf_config = getattr(hf_config, "text_config", None) or hf_config
    return [layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)]


def kv_free_window(hf_config: Any) -> int | None:
    """The window past which the KV manager may free a request's blocks: the widest window
    when every layer slides; None when any layer is global (its blocks stay for it)."""
    hf_config = getattr(hf_config, "text_config", None) or hf_config  # a VLM's language model
    windows = [layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
