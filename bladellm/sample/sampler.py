"""The sampler the model runner calls every step: logits [R, V] -> one token per row.

Order of application (see docs/sampling.md):
  1. logprobs of the RAW logits (log_softmax of the model's output, before anything below);
  2. the grammar's token bitmask (structured output); logit_bias; min_tokens banning (-inf); repetition penalty; presence/frequency penalties;
  3. greedy rows: argmax of the processed logits;
  4. random rows: temperature, top-k, top-p, min-p, then one inverse-CDF draw per row
     (``draw.sample_random``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bladellm.guided.bitmask import apply_token_bitmask
from bladellm.kernels.interface import Kernels
from bladellm.sample import draw, ops
from bladellm.sample.logprobs import gather_logprobs
from bladellm.sample.metadata import GREEDY_TEMPERATURE, SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [R] int64
    # [R, 1 + max_num_logprobs]: the sampled token first, then the top-k ids (most likely first).
    logprobs_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None  # [R, 1 + max_num_logprobs] float32, matching the ids
    sampled_ranks: torch.Tensor | None  # [R] int64, rank of the sampled token (1 = argmax)


class Sampler(nn.Module):
    """Stateless; all per-request state arrives in ``SamplingMetadata``.

    ``logits`` is not modified: processing works on a copy, made only when some row needs it,
    unless the caller passes ``inplace=True`` (it does not use ``logits`` afterwards). The model
    runner does: the copy is a full [rows, vocab] pass that a structured-output step would pay
    on top of an unconstrained one.

    ``kernels``: the worker's kernel set, for the grammar bitmask (default: the reference).
    """

    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels if kernels is not None else Kernels()

    def forward(self, logits: torch.Tensor, md: SamplingMetadata, *,
                inplace: bool = False) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        if not md.no_logits_processing:
            logits = self.process_logits(logits if inplace else logits.clone(), md)

        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif md.all_random:
            sampled = draw.sample_random(logits, _row_filters(md), md.generators)
        else:
            sampled = _sample_mixed(logits, md)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return _gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)

    def process_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Grammar mask, logit bias, min-tokens bans and penalties applied to ``logits``, which
        may be modified (callers pass a copy they own); the speculative verification step
        applies the same before its rejection test."""
        if md.grammar_rows is not None:
            logits = apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask,
                                         self.kernels)
        if md.logit_bias:
            logits = ops.apply_logit_bias(logits, md.logit_bias)
        if md.min_tokens_banned:
            logits = ops.apply_banned_tokens(logits, md.min_tokens_banned)
        if md.repetition_penalty is not None:
            logits = ops.apply_repetition_penalty(logits, md.repetition_penalty,
                                                  md.prompt_token_ids, md.output_token_ids)
        if md.presence_penalty is not None or md.frequency_penalty is not None:
            logits = ops.apply_presence_frequency_penalties(
                logits, md.presence_penalty, md.frequency_penalty, md.output_token_ids)
        return logits


def _row_filters(md: SamplingMetadata) -> draw.RowFilters:
    return draw.RowFilters(md.temperature, md.top_k, md.top_p, md.min_p)


def _sample_mixed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Greedy rows take their argmax; only the random rows go through the draw."""
    is_random = md.temperature >= GREEDY_TEMPERATURE
    sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    greedy_rows = (~is_random).nonzero().squeeze(1)
    sampled[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    rows = is_random.nonzero().squeeze(1)
    position = {row: i for i, row in enumerate(rows.tolist())}
    generators = {position[row]: g for row, g in md.generators.items() if row in position}
    sampled[rows] = draw.sample_random(logits[rows], _row_filters(md).select(rows), generators)
    return sampled


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                     num_logprobs: int) -> SamplerOutput:
    ids, values, ranks = gather_logprobs(raw_logprobs, sampled, num_logprobs)
    return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs_token_ids=ids,
                         logprobs=values, sampled_ranks=ranks)
