"""Logprobs of chosen tokens: the one computation behind sampled-token logprobs (the sampler,
speculative verification) and prompt logprobs, and the one type they travel in
(``core.outputs.Logprobs``, from the runner to the output processor unchanged)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bladellm.core.outputs import Logprobs
from bladellm.sample import draw


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of ``logprobs`` ([R, V], log-softmaxed) and one chosen token per row ([R]):
    ids [R, 1 + num_top] (the chosen token, then the ``num_top`` most likely, most likely first,
    ties by id), their logprobs (same shape, float32) and the chosen token's rank [R] int64
    (1 = most likely; it shares the best rank of any tie it is in)."""
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    if num_top > 0:
        top_values, top_ids = draw.top_candidates(logprobs, num_top)
    else:
        top_values = logprobs[:, :0]
        top_ids = torch.zeros((logprobs.shape[0], 0), dtype=torch.int64, device=logprobs.device)
    # Strictly greater; an int32 sum: summing the bool mask into int64 converts it first.
    ranks = (logprobs > chosen).sum(dim=-1, dtype=torch.int32).to(torch.int64) + 1
    return (torch.cat([chosen_ids, top_ids], dim=1), torch.cat([chosen, top_values], dim=1),
            ranks)


def to_logprobs(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> Logprobs:
    """``gather_logprobs``'s tensors (rows: positions of one request) as the wire type."""
    return Logprobs(token_ids=ids.tolist(), logprobs=values.float().tolist(),
                    ranks=ranks.tolist())


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """``gather_logprobs`` of one request's positions, as the wire type."""
    return to_logprobs(*gather_logprobs(logprobs, token_ids, num_top))


_LOGITS_CHUNK = 256  # prompt positions per logits matmul: bounds the [chunk, vocab] buffer


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, next_token_ids: torch.Tensor, num_top: int) -> Logprobs:
    """Logprobs of ``next_token_ids[j]`` given the prefix whose last hidden state is
    ``hidden[j]`` (consecutive prompt positions of one request), from the model's raw logits."""
    parts = []
    for start in range(0, len(next_token_ids), _LOGITS_CHUNK):
        end = start + _LOGITS_CHUNK
        logprobs = compute_logits(hidden[start:end]).float().log_softmax(dim=-1)
        parts.append(gather_logprobs(logprobs, next_token_ids[start:end], num_top))
    ids, values, ranks = (torch.cat(columns) for columns in zip(*parts))
    return to_logprobs(ids, values, ranks)
