"""What users get back from ``LLM.generate`` and ``AsyncLLM.generate``."""

from __future__ import annotations

from dataclasses import dataclass, field

from bladellm.errors import ErrorKind


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None
    decoded: str
    # The token's raw bytes (part of a multi-byte character when ``decoded`` is U+FFFD); None:
    # not known, use the UTF-8 of ``decoded``.
    token_bytes: bytes | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # One entry per generated token: that token's logprob first, then the top-k alternatives.
    logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed inside the engine
    error_kind: ErrorKind | None = None  # set with error: why it failed (the HTTP status)
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per token its
    # logprob first and the top-k after (as CompletionOutput.logprobs); with delta outputs
    # only the first output of the request carries it.
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
