"""What the scheduler reports each step: one ``EngineCoreOutput`` per request that changed, plus
``SchedulerStats``.

They are msgspec structs because the same objects cross the process boundary unchanged
(``engine/messages.py`` wraps them in ``EngineCoreOutputs``): built once in the scheduler, encoded
once, never re-packed. Pure data: nothing here imports torch or the engine.
"""

from __future__ import annotations

import msgspec

from bladellm.errors import ErrorKind

# EngineCoreOutput.error of a request that waited past --max_queue_time (its kind QUEUE_TIMEOUT).
QUEUE_TIMEOUT_ERROR = "queue_timeout"


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of consecutive positions of one request: per position, [chosen token, top-1,
    ..., top-k] ids and their logprobs, and the chosen token's rank (1 = most likely).

    The one shape of logprobs inside the engine: the runner makes it (``sample/logprobs.py``)
    for sampled tokens and prompt tokens alike, the scheduler forwards it, the output processor
    renders it (token text) for the user."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def head(self, num_positions: int) -> "Logprobs":
        """The first ``num_positions`` positions (all of them: this object)."""
        if num_positions >= len(self.ranks):
            return self
        return Logprobs(self.token_ids[:num_positions], self.logprobs[:num_positions],
                        self.ranks[:num_positions])


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None  # what failed; the front end maps error_kind to the status
    error_kind: ErrorKind | None = None  # set with error
    num_cached_tokens: int = 0  # prompt-cache hit (tokens) on first admission
    queued_time: float = 0.0  # seconds from arrival to first scheduled; sent with the first output
    # Finished because its grammar was complete: the last token is text, not a stop token.
    grammar_complete: bool = False
    # Speculative decoding, sent with the final output: proposed tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: every prompt token after the first, computed during the
    # request's own prefill; sent once, with its first token (engine/prompt_logprobs.py).
    prompt_logprobs: Logprobs | None = None


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative tokens prefilled (after cache hits)
    num_generation_tokens: int = 0  # cumulative tokens sampled
    num_steps: int = 0
    # Structured output (filled by the engine core): cumulative grammar compilations and
    # compiled-grammar cache hits.
    num_grammar_compiles: int = 0
    num_grammar_cache_hits: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters).
    num_spec_drafts: int = 0  # request-steps that verified a proposal
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # sps: request-steps whose draft did not run, by reason ("cost", "length"; cumulative).
    num_spec_declined: dict[str, int] = msgspec.field(default_factory=dict)
    # Cumulative wall seconds per step phase (core/step_phases.py; filled by the engine core).
    step_seconds: dict[str, float] = msgspec.field(default_factory=dict)
