"""Prompt logprobs on /v1/completions, rendered from ``RequestOutput.prompt_logprobs`` (computed
in the request's own prefill): vLLM's ``prompt_logprobs`` field and OpenAI's ``echo`` with
``logprobs`` (the prompt's tokens lead the choice's logprobs, the first one with null)."""

from __future__ import annotations

from typing import Any

from bladellm.http.errors import bad_request
from bladellm.entrypoints.openai.protocol import CompletionLogprobs
from bladellm.entrypoints.openai.serving_common import (ServingContext, completion_logprobs,
                                                       json_logprob)
from bladellm.outputs import TokenLogprob

MAX_PROMPT_LOGPROBS = 20


def check(value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_PROMPT_LOGPROBS:
        raise bad_request(f"prompt_logprobs: must be in [0, {MAX_PROMPT_LOGPROBS}], got {value}",
                          "prompt_logprobs")


def vllm_format(entries: list[list[TokenLogprob]]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then {token id: {logprob, rank,
    decoded_token}} with the prompt token and the top-k."""
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        out.append({str(t.token_id): {"logprob": json_logprob(t.logprob), "rank": t.rank,
                                      "decoded_token": t.decoded} for t in entry})
    return out


def echo_logprobs(ids: list[int], entries: list[list[TokenLogprob]],
                  ctx: ServingContext, num_top: int) -> CompletionLogprobs:
    """OpenAI's echo with logprobs: the prompt's tokens, the first one with null logprobs."""
    first = ctx.tokenizer.decode([ids[0]], skip_special_tokens=False)
    result = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None],
                                text_offset=[0])
    return completion_logprobs([e[:1 + num_top] for e in entries], len(first), result)
