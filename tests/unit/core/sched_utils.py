"""Helpers for scheduler tests: request/scheduler factories and a fake model runner.

``FakeRunner`` plays the worker's side of the contract: it applies ``SchedulerOutput`` diffs to
its own copy of each request (tokens, block table), checks them against the scheduler's view,
and keeps a fake KV store (block -> slot -> (position, token, LoRA id)) so that every read of a
cached or computed prefix is checked against what was actually written there, and every write
goes to a block the request alone holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bladellm.config import CacheConfig, SchedulerConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.core.outputs import Logprobs
from bladellm.core.scheduler import Scheduler
from bladellm.request import Request
from bladellm.sampling_params import SamplingParams

EOS = 2


def make_request(req_id: str, prompt: list[int] | int, *, max_tokens: int | None = 8,
                 arrival_time: float | None = 0.0, max_model_len: int | None = None,
                 **params) -> Request:
    if isinstance(prompt, int):
        prompt = [10 + i for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, prompt, sp, max_model_len=max_model_len,
                   arrival_time=arrival_time)


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 64,
                   disable_prompt_cache: bool = False, max_queue_time: float | None = None,
                   clock: Callable[[], float] | None = None,
                   speculative=None, eos_token_ids: tuple[int, ...] = (EOS,)) -> Scheduler:
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_queue_time=max_queue_time)
    cache_cfg = CacheConfig(block_size=block_size, disable_prompt_cache=disable_prompt_cache)
    kwargs = {"clock": clock} if clock is not None else {}
    if speculative is not None:
        kwargs["speculative"] = speculative
    return Scheduler(sched_cfg, cache_cfg, num_blocks, max_model_len,
                     eos_token_ids=eos_token_ids, **kwargs)


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    scheduler: Scheduler
    # Scripted tokens per request (consumed in order); otherwise ``default_token``.
    scripted: dict[str, list[int]] = field(default_factory=dict)
    default_token: int = 7
    sampler: Callable[[str], int] | None = None  # req_id -> token, when not scripted
    states: dict[str, _RunnerState] = field(default_factory=dict)
    # block -> slot -> (position, token, LoRA id): what a real KV depends on, in miniature.
    kv: dict[int, dict[int, tuple]] = field(default_factory=dict)
    # Speculative decoding: req_id -> proposal for the next step, and (req_id, k) -> how many
    # of k verified proposals are accepted. Rejected proposals' KV is written like a real
    # runner's, so a rollback that kept it would be caught by the read check.
    propose: Callable[[str], list[int]] | None = None
    accept: Callable[[str, int], int] | None = None

    def execute(self, so: SchedulerOutput, *, tokens_per_step: int = 1,
                errored: dict[str, str] | None = None,
                logprobs: bool = False) -> ModelRunnerOutput:
        sched = self.scheduler
        bs = sched.block_size
        pool = sched.kv_cache_manager.pool
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, "new request the runner already holds"
            self.states[new.req_id] = _RunnerState(list(new.token_ids), list(new.block_ids),
                                                   new.num_computed_tokens)
        for diff in so.scheduled_cached_reqs:
            state = self.states[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            state.block_ids.extend(diff.new_block_ids)
            assert state.num_computed_tokens == diff.num_computed_tokens
        assert set(so.num_scheduled_tokens) == ({n.req_id for n in so.scheduled_new_reqs}
                                                | {c.req_id for c in so.scheduled_cached_reqs})
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs

        req_ids, sampled, lps, proposals = [], [], {}, {}
        for req_id, num in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            req = sched.requests[req_id]
            assert state.token_ids == req.all_token_ids, "runner's tokens diverged"
            assert state.block_ids == sched.kv_cache_manager.get_block_ids(req_id)
            assert 0 not in state.block_ids
            spec = list(so.scheduled_spec_tokens.get(req_id, []))
            start, end = state.num_computed_tokens, state.num_computed_tokens + num
            assert num >= 1 and end <= len(state.token_ids) + len(spec)
            assert not spec or end == len(state.token_ids) + len(spec)
            tokens = state.token_ids + spec
            assert len(state.block_ids) * bs >= end
            for pos in range(start):  # reads: cached / computed prefix holds our tokens
                slot = self.kv.get(state.block_ids[pos // bs], {}).get(pos % bs)
                assert slot == (pos, state.token_ids[pos], req.lora_id), \
                    f"{req_id} reads bad KV at {pos}"
            for pos in range(start, end):  # writes: only into blocks we alone hold, unshared
                block = state.block_ids[pos // bs]
                assert pool.ref_cnt[block] == 1 and pool.block_hash[block] is None, \
                    f"{req_id} writes into shared block {block}"
                written = (pos, tokens[pos], req.lora_id)
                self.kv.setdefault(block, {})[pos % bs] = written
            state.num_computed_tokens = end
            req_ids.append(req_id)
            if end >= len(state.token_ids):
                script = self.scripted.get(req_id)
                toks = [script.pop(0) if script else
                        self.sampler(req_id) if self.sampler else self.default_token
                        for _ in range(tokens_per_step)]
                if spec:
                    num_accepted = self.accept(req_id, len(spec)) if self.accept else len(spec)
                    toks = spec[:num_accepted] + toks[:1]
                    state.num_computed_tokens = end - (len(spec) - num_accepted)
                    # Stopped inside the accepted tokens: the scheduler keeps only those emitted.
                sampled.append(toks)
                if self.propose is not None:
                    proposals[req_id] = self.propose(req_id)
                if logprobs:
                    lps[req_id] = Logprobs(token_ids=[[t, t] for t in toks],
                                           logprobs=[[-0.5, -0.5] for _ in toks],
                                           ranks=[1 for _ in toks])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=lps,
                                 errored=dict(errored or {}), spec_token_ids=proposals)


def step(sched: Scheduler, runner: FakeRunner, **kwargs):
    """One engine step: schedule, execute, update, check invariants."""
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so, **kwargs))
    sched.check_invariants()
    return so, outs


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000):
    """Step until nothing is left; returns {req_id: (all new tokens, last output)}."""
    results: dict[str, tuple[list[int], object]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        _, outs = step(sched, runner)
        for o in outs:
            toks, _ = results.get(o.request_id, ([], None))
            results[o.request_id] = (toks + o.new_token_ids, o)
    raise AssertionError("requests did not finish: scheduler made no progress")
