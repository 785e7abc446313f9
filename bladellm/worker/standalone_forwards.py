"""Forward passes outside the generation step: no scheduler, no KV blocks, no sampler.

- ``embed_prompts``: embeddings, one forward per prompt with no KV cache, pooled into one
  vector. An embedding request reads its prompt once and keeps nothing, so it runs as a plain
  causal forward (``ForwardContext.no_cache``) between engine steps.
- ``time_token_forward``: the cost of a one-token forward, timed at start-up (the sps cost
  rule's draft/target ratio).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from bladellm.model.forward_context import ForwardContext
from bladellm.platforms.select import platform_of
from bladellm.checkpoint.pooling_config import POOLING_TYPES


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
        if hidden is None:
            continue  # a pipeline stage before the last: the last one answers
        pooled = hidden[-1] if pooling == "last" else hidden.float().mean(dim=0)
        result.append(pooled.float().tolist())
    return result


@torch.inference_mode()
def time_token_forward(model: nn.Module, device: torch.device, reps: int = 5) -> float:
    """Median seconds of a one-token forward with its LM-head row (a plain causal forward, no
    cache): what a decode step of this model costs at batch 1, weights streamed once."""
    platform = platform_of(device)
    input_ids = torch.ones(1, dtype=torch.long, device=device)
    positions = torch.zeros(1, dtype=torch.long, device=device)
    times = []
    for i in range(reps + 2):  # two warm-ups: first-call allocations, lazy kernel setup
        start = time.perf_counter()
        hidden = model(input_ids, positions, ForwardContext.no_cache())
        if hidden is not None:
            model.compute_logits(hidden)
        platform.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
