"""The runner's persistent per-request state, and the flat batch built from it each step.

The scheduler sends new requests in full and running ones as diffs; ``RequestStates`` applies them
so the runner always knows every scheduled request's tokens and block table. ``build_step_inputs``
turns one ``SchedulerOutput`` into flat, unpadded tensors: decodes first (query_len 1), then
prefill chunks, the order the attention backend expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from bladellm.attention.backend import AttentionMetadata
from bladellm.core.interface import SchedulerOutput
from bladellm.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class RequestStates:
    states: dict[str, RequestState] = field(default_factory=dict)

    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.states[new.req_id] = RequestState(
                req_id=new.req_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, sampling_params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=frozenset(new.eos_token_ids))
        for diff in sched.scheduled_cached_reqs:
            state = self.states[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens


@dataclass
class StepInputs:
    req_ids: list[str]  # batch order: decodes first, then prefill chunks
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    # Requests whose step reaches the end of their known tokens: they sample one token.
    sample_req_ids: list[str]
    logits_indices: torch.Tensor  # [len(sample_req_ids)] index into the flat tokens


def build_step_inputs(sched: SchedulerOutput, states: RequestStates, block_size: int,
                      device: torch.device) -> StepInputs:
    num_sched = sched.num_scheduled_tokens
    # Stable order: decodes (one token) first, then chunks; within each, scheduler order.
    req_ids = sorted(num_sched, key=lambda r: num_sched[r] != 1)
    num_decodes = sum(1 for r in req_ids if num_sched[r] == 1)

    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    query_start = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_req_ids: list[str] = []
    logits_indices: list[int] = []
    for req_id in req_ids:
        state = states.states[req_id]
        start = state.num_computed_tokens
        n = num_sched[req_id]
        end = start + n
        input_ids.extend(state.token_ids[start:end])
        pos = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(state.block_ids, dtype=np.int64)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)
        tables.append(state.block_ids)
        if end == len(state.token_ids):
            sample_req_ids.append(req_id)
            logits_indices.append(query_start[-1] - 1)

    max_blocks = max(len(t) for t in tables)
    table_arr = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        table_arr[i, :len(t)] = t

    def dev(x) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x, dtype=np.int64)).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        num_reqs=len(req_ids), num_decodes=num_decodes, num_actual_tokens=len(input_ids),
        query_start_loc=dev(query_start), seq_lens=dev(seq_lens), block_tables=dev(table_arr),
        slot_mapping=dev(np.concatenate(slots)), query_start_loc_cpu=query_start,
        seq_lens_cpu=seq_lens, max_seq_len=max(seq_lens))
    return StepInputs(
        req_ids=req_ids, input_ids=dev(input_ids), positions=dev(np.concatenate(positions)),
        metadata=metadata, sample_req_ids=sample_req_ids, logits_indices=dev(logits_indices))
