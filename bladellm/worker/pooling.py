"""Embeddings: one forward pass per prompt with no KV cache, pooled into one vector.

Kept apart from the generation step on purpose (no scheduler, no KV blocks, no sampler): an
embedding request reads its prompt once and keeps nothing, so it runs as a plain causal forward
(``ForwardContext.no_cache``) between engine steps.
"""

from __future__ import annotations

import torch
from torch import nn

from bladellm.model.forward_context import ForwardContext
from bladellm.model.pooling_config import POOLING_TYPES


@torch.inference_mode()
def embed_prompts(model: nn.Module, prompts: list[list[int]], pooling: str,
                  device: torch.device) -> list[list[float]]:
    """Pooled final hidden states (float32, not normalized) of each prompt."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling: must be one of {POOLING_TYPES}, got {pooling!r}")
    result = []
    for ids in prompts:
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        positions = torch.arange(len(ids), dtype=torch.long, device=device)
        hidden = model(input_ids, positions, ForwardContext.no_cache())
        pooled = hidden[-1] if pooling == "last" else hidden.float().mean(dim=0)
        result.append(pooled.float().tolist())
    return result
