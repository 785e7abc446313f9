"""Prompt logprobs as the front end hands them on: ``TokenLogprob`` lists, the prompt token
first (with its rank), then the top-k ranked 1..k, one list per prompt token after the first."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from bladellm.outputs import TokenLogprob


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
