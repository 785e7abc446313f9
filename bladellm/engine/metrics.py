"""Per-request and per-iteration statistics, measured in the front-end process.

The front end (AsyncLLM / LLMEngine) timestamps outputs as they arrive from the engine core and
hands these records to every ``StatLogger`` (Prometheus in the server, a log line offline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from bladellm.engine.messages import SchedulerStats


@dataclass
class IterationStats:
    """What one batch of engine-core outputs told us."""

    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per new first token
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between tokens
    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    output_processing_seconds: float = 0.0  # the front end's work on this batch of outputs


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queued_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: proposed tokens verified
    num_accepted_tokens: int = 0  # of those, accepted


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               finished: list[FinishedRequestStats]) -> None: ...
