"""A request as the engine core sees it, and its status machine.

    WAITING ──schedule──► RUNNING ──preempt──► PREEMPTED ──schedule──► RUNNING
       │                     │                     │
       └──────abort──────────┴─────────────────────┴──► FINISHED_{STOPPED,LENGTH,ABORTED,ERROR}

Accounting rule: ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (tokens whose
KV is in the cache). Every step the scheduler grants tokens so that the second catches up with the
first; chunked prefill, prompt-cache hits and recompute after preemption are all the same rule.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

from bladellm.multimodal.inputs import MultiModalItem
from bladellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class GrammarMatcher(Protocol):
    """A request's output constraint as the scheduler sees it (``bladellm.guided`` implements
    it). Accepting takes a list so that speculative decoding can accept several tokens at once."""

    def is_ready(self) -> bool: ...  # compiled; False while compiling or after a failure

    @property
    def error(self) -> str | None: ...

    def accept_tokens(self, token_ids: list[int]) -> int: ...  # how many were valid

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...  # no token can extend the output: it is complete


class SpecStats:
    """Per-request speculation counters and the acceptance estimate behind the fallback rule."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "ev_accepted",
                 "ev_proposed", "draft_known")

    def __init__(self) -> None:
        self.num_drafts = 0  # steps that verified a proposal
        self.num_draft_tokens = 0  # proposed tokens verified
        self.num_accepted_tokens = 0  # of those, accepted
        # Fading evidence behind the acceptance estimate (core/spec_decode.estimate).
        self.ev_accepted = 0.0
        self.ev_proposed = 0.0
        self.draft_known = 0  # sps: tokens the draft had seen when it last ran for the request


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        priority: int = 0,
        mm_items: list[MultiModalItem] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # The LoRA adapter (``bladellm.lora.LoRARequest``) or None; 0 = the base model.
        self.lora_request = lora_request
        self.lora_id: int = lora_request.lora_int_id if lora_request is not None else 0
        # --scheduling_policy priority: lower runs first (ignored by fcfs, which the front end
        # only lets 0 through to).
        self.priority = priority
        # Images, in prompt order: each replaces the input embeddings of its token span.
        self.mm_items: list[MultiModalItem] = list(mm_items or ())
        # Set by the scheduler on arrival: its place under priority scheduling
        # (core/request_queue.py), fixed for the request's life.
        self.schedule_key: tuple[float, int] = (0.0, 0)

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt-cache hit on first admission; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Hashes of this request's full blocks, computed lazily by the KV manager.
        self.block_hashes: list[int] = []
        # Structured output: admitted once ready; advanced with every output token.
        self.grammar: GrammarMatcher | None = None
        self.grammar_complete = False  # finished because the grammar cannot be extended
        # Speculative decoding (docs/speculative.md): the chain of proposed tokens to verify next
        # step, or the size of the look_ahead tree (window + guesses) the runner asked for. Never
        # part of all_token_ids: only verified tokens are appended.
        self.spec_token_ids: list[int] = []
        self.spec_tree_size = 0
        self.spec_stats = SpecStats()

        max_tokens = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(prompt_token_ids)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        if max_tokens is None:
            raise ValueError("max_tokens: required when max_model_len is unknown")
        self.max_tokens = max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
