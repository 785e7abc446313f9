"""Prompt logprobs as the front end hands them on: ``TokenLogprob`` lists, the prompt token
first (with its rank), then the top-k ranked 1..k, one list per prompt token after the first."""

from __future__ import annotations

from typing import Any

from bladellm.core.outputs import Logprobs
from bladellm.engine.output_processor import LogprobRenderer
from bladellm.outputs import TokenLogprob
from bladellm.sampling_params import SamplingParams


def to_token_logprobs(raw: list[list[Any]],
                      renderer: LogprobRenderer) -> list[list[list[TokenLogprob]]]:
    """The worker's per-prompt (ids, logprobs, rank) positions, rendered like sampled ones."""
    return [renderer.render(Logprobs([ids for ids, _, _ in prompt], [lps for _, lps, _ in prompt],
                                     [rank for _, _, rank in prompt]))
            for prompt in raw]


def wanted(params: SamplingParams, lora_request: Any) -> int | None:
    """How many top alternatives the request's prompt logprobs want (None: none wanted); raises
    where they cannot be computed."""
    if params.prompt_logprobs is not None and lora_request is not None:
        # The extra forward runs the base model: its numbers would not be the adapter's.
        raise ValueError("prompt_logprobs: not supported with a LoRA adapter")
    return params.prompt_logprobs


def with_first(entries: list[list[TokenLogprob]]) -> list[list[TokenLogprob] | None]:
    """vLLM's layout of ``RequestOutput.prompt_logprobs``: None for the first token (nothing
    precedes it), then one entry per later prompt token."""
    return [None, *entries]
