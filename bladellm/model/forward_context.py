"""The one context every layer of a forward pass receives, passed explicitly down the model.

Built by the model runner once per step. Attention reads ``attn_metadata`` and its layer's KV
cache; the fields below it are the seams later features fill: per-token LoRA adapter indices for
the linear layers. (An int8 KV cache needs no field: each row's scale is stored next to it in
the layer's cache tensor, see ``kernels/kv_int8.py``.) A field a feature does not use
stays ``None``, so layers pay nothing for features that are off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bladellm.attention.backend import AttentionMetadata


@dataclass
class ForwardContext:
    # None: a plain causal forward over all tokens without KV cache (profiling / dummy runs).
    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor]  # one per layer (index = layer index)
    # Hybrid KV cache groups (core/kv_groups.py): each layer's metadata (its group's block
    # tables and slot mapping; index = layer index). None: every layer uses attn_metadata.
    layer_attn_metadata: list[AttentionMetadata] | None = None
    # Per-token adapter slot and the adapters' stacked weights (the LoRA work sets this).
    lora: Any = None

    @classmethod
    def no_cache(cls) -> "ForwardContext":
        return cls(attn_metadata=None, kv_caches=[])
