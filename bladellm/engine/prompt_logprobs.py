"""Prompt logprobs as the front end hands them on: ``TokenLogprob`` lists, the prompt token
first (with its rank), then the top-k ranked 1..k, one list per prompt token after the first."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from bladellm.outputs import TokenLogprob
from bladellm.sampling_params import SamplingParams


def to_token_logprobs(raw: list[list[Any]], tokenizer: Any) -> list[list[list[TokenLogprob]]]:
    @lru_cache(maxsize=None)
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    result = []
    for prompt in raw:
        entries = []
        for ids, lps, rank in prompt:
            entry = [TokenLogprob(ids[0], lps[0], rank, text(ids[0]))]
            entry.extend(TokenLogprob(t, v, r, text(t))
                         for r, (t, v) in enumerate(zip(ids[1:], lps[1:]), start=1))
            entries.append(entry)
        result.append(entries)
    return result


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
