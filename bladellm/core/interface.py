"""The contract between the scheduler and the workers.

``SchedulerOutput`` carries new (or resumed-after-preemption) requests in full and running ones as
diffs; ``ModelRunnerOutput`` comes back from rank 0 / the last pipeline stage. Plain dataclasses of
Python scalars and lists: picklable for a multi-process executor, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bladellm.core.outputs import Logprobs
from bladellm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (the runner dropped it)."""

    req_id: str
    # Prompt + output generated so far (non-empty output only when resumed after preemption).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prompt-cache hit (or 0)
    lora_id: int = 0  # LoRA adapter (0: the base model)
    # Images (bladellm.multimodal.inputs.MultiModalItem), in prompt order.
    mm_items: list[Any] = field(default_factory=list)
    # Hybrid KV cache groups (core/kv_groups.py): the tables of groups 1, 2, ...; ``block_ids``
    # is group 0's. Empty with one group.
    group_block_ids: tuple[list[int], ...] = ()

    @classmethod
    def of(cls, req: Any, block_ids: Sequence[Sequence[int]],
           num_computed_tokens: int) -> "NewRequestData":
        """The whole of scheduler request ``req`` (``core.scheduler.Request``) for a runner that
        does not hold it, with ``block_ids`` per KV cache group: one place, so a re-sent
        request (preemption, step isolation) never loses a part such as its images."""
        return cls(req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                   req.sampling_params, list(block_ids[0]), num_computed_tokens,
                   lora_id=req.lora_id, mm_items=req.mm_items,
                   group_block_ids=tuple(list(b) for b in block_ids[1:]))


@dataclass
class CachedRequestData:
    """A request already in the runner's persistent batch: what changed since its last step."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since last scheduled (the ones sampled last step)
    new_block_ids: list[int]  # blocks appended to its block table (KV cache group 0's)
    num_computed_tokens: int
    # Blocks appended to the tables of KV cache groups 1, 2, ... (empty with one group).
    new_group_block_ids: tuple[list[int], ...] = ()
    # --async_scheduling: the last scheduled token is the one its previous step samples, not
    # in ``new_token_ids`` yet: the runner takes it from that step's sampled ids (on the device).
    pending_token: bool = False


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to run this step (a prefill chunk, 1 for a decode).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget: finished/aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: the token bitmask of the constrained requests that sample this step,
    # filled in the background while the model runs (``bladellm.guided.manager.StepBitmask``:
    # ``req_ids`` and ``result()`` -> [len(req_ids), ceil(V / 32)] int32). None: no constraint.
    grammar_bitmask: Any = None
    # Speculative decoding (docs/speculative.md). Counted in num_scheduled_tokens:
    # req_id -> proposed tokens to verify after the request's own tokens (a chain: sps, n-gram);
    # req_id -> query tokens of a look_ahead tree (Jacobi window + guesses) this step.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_spec_tree: dict[str, int] = field(default_factory=dict)
    # sps: requests the draft proposes for at the end of this step (the cost rule's choice; the
    # draft does not run for the others, nor at all when this is empty).
    spec_propose: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Aligned with req_ids; [] for a request whose step was a prefill chunk that did not reach the
    # end of its tokens (nothing to sample yet).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # of the sampled tokens
    # Requests with SamplingParams.prompt_logprobs: the prompt tokens after this step's chunk
    # positions (from num_computed_tokens + 1 on; see ModelRunner._prompt_logprobs).
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Requests whose step failed (e.g. a bad logit_bias id): finish with an error, not the engine.
    errored: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: sampled_token_ids holds the accepted proposals then one token from
    # the target (correction or bonus). Proposals for the next step, per request:
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # a chain to verify
    spec_tree_sizes: dict[str, int] = field(default_factory=dict)  # look_ahead tree query tokens
    # Wall seconds of this step's runner phases on the driver (core/step_phases.RUNNER_PHASES).
    phase_seconds: dict[str, float] = field(default_factory=dict)

