"""The sampler the model runner calls every step: logits [R, V] -> one token per row.

Order of application (see docs/sampling.md):
  1. logprobs of the RAW logits (log_softmax of the model's output, before anything below);
  2. logit_bias; min_tokens banning (-inf); repetition penalty; presence/frequency penalties;
  3. greedy rows: argmax of the processed logits;
  4. random rows: temperature, top-k, top-p, min-p, then one exponential-race draw per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bladellm.sample import ops
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

    ``logits`` is never modified: processing works on a copy, made only when some row needs it.
    """

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        if not md.no_logits_processing:
            logits = self._process_logits(logits.clone(), md)

        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy = None if md.all_random else logits.argmax(dim=-1)
            # _sample_random works in place, so it must not see the caller's logits.
            owned = logits if not md.no_logits_processing else logits.clone()
            sampled = self._sample_random(owned, md)
            if greedy is not None:
                sampled = torch.where(md.temperature < GREEDY_TEMPERATURE, greedy, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return _gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)

    @staticmethod
    def _process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
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

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.temperature is not None:
            logits = ops.apply_temperature(logits, md.temperature, GREEDY_TEMPERATURE)
        top_k = md.top_k
        if top_k is not None and not md.all_random and md.temperature is not None:
            # Greedy rows' k is irrelevant; 1 keeps a greedy row's "off" from forcing a full sort.
            top_k = torch.where(md.temperature < GREEDY_TEMPERATURE, 1, top_k)
        logits = ops.apply_top_k_top_p(logits, top_k, md.top_p)
        if md.min_p is not None:
            logits = ops.apply_min_p(logits, md.min_p)
        return ops.random_sample(logits.softmax(dim=-1), md.generators)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                     num_logprobs: int) -> SamplerOutput:
    sampled = sampled.to(torch.int64)
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    # Strictly greater: the sampled token shares the best rank of any tie it is in.
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        sampled_ranks=ranks,
    )
