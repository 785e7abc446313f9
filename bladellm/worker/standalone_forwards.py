"""Forward passes outside the generation step: no scheduler, no KV blocks, no sampler.

- ``embed_prompts``: embeddings, one forward per prompt with no KV cache, pooled into one
  vector. An embedding request reads its prompt once and keeps nothing, so it runs as a plain
  causal forward (``ForwardContext.no_cache``) between engine steps.
- ``prompt_logprobs``: the logprob of every prompt token, one extra prefill per prompt.
- ``time_token_forward``: the cost of a one-token forward, timed at start-up (the sps cost
  rule's draft/target ratio).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch import nn

from bladellm.model.forward_context import ForwardContext
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


_LOGITS_CHUNK = 256  # prompt positions per logits matmul: bounds the [chunk, vocab] buffer


@torch.inference_mode()
def prompt_logprobs(model: nn.Module, prompts: list[list[int]], num_top: int,
                    device: torch.device,
                    make_context: Callable[[int], ForwardContext] | None = None
                    ) -> list[list[tuple[list[int], list[float], int]]]:
    """For each prompt, for each token after the first: ([token, *top ids], [its logprob,
    *top logprobs], its rank). A separate forward, like ``embed_prompts``: prompt logprobs cost
    one extra prefill of the prompt but leave the generation step untouched.
    ``make_context(num_tokens)``: the forward's context, e.g. a paged prefill into a scratch
    cache of the engine's KV layout (the worker's choice: an int8 KV cache must be read as
    generation reads it); default a plain causal forward without cache."""
    result = []
    for ids in prompts:
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        positions = torch.arange(len(ids), dtype=torch.long, device=device)
        ctx = ForwardContext.no_cache() if make_context is None else make_context(len(ids))
        hidden = model(input_ids, positions, ctx)
        del ctx  # the scratch cache goes before the logits are computed
        if hidden is None:
            continue  # a pipeline stage before the last: the last one answers
        entries: list[tuple[list[int], list[float], int]] = []
        for start in range(0, len(ids) - 1, _LOGITS_CHUNK):
            end = min(start + _LOGITS_CHUNK, len(ids) - 1)
            lp = torch.log_softmax(model.compute_logits(hidden[start:end]).float(), dim=-1)
            target = input_ids[start + 1:end + 1]
            chosen = lp.gather(1, target[:, None])[:, 0]
            ranks = (lp > chosen[:, None]).sum(dim=1) + 1
            if num_top:
                top_v, top_i = lp.topk(num_top, dim=-1)
            for j in range(end - start):
                tok_ids = [int(target[j])] + (top_i[j].tolist() if num_top else [])
                tok_lps = [float(chosen[j])] + (top_v[j].tolist() if num_top else [])
                entries.append((tok_ids, tok_lps, int(ranks[j])))
        result.append(entries)
    return result


@torch.inference_mode()
def time_token_forward(model: nn.Module, device: torch.device, reps: int = 5) -> float:
    """Median seconds of a one-token forward with its LM-head row (a plain causal forward, no
    cache): what a decode step of this model costs at batch 1, weights streamed once."""
    input_ids = torch.ones(1, dtype=torch.long, device=device)
    positions = torch.zeros(1, dtype=torch.long, device=device)
    times = []
    for i in range(reps + 2):  # two warm-ups: first-call allocations, lazy kernel setup
        start = time.perf_counter()
        hidden = model(input_ids, positions, ForwardContext.no_cache())
        if hidden is not None:
            model.compute_logits(hidden)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
