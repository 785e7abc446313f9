"""--async_scheduling's accounting, driven like ``EngineCore._pipelined_step`` at depth 2 with a
fake runner that, like the device, knows the token it sampled last step before the scheduler
does: step n + 1 is scheduled and run before step n's output is applied."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import pytest

from bladellm.core.interface import ModelRunnerOutput
from sched_utils import EOS, make_request, make_scheduler
from test_scheduler import assert_all_blocks_free


def _token(req_id: str, position: int) -> int:
    """What the model samples at ``position``: a function of the position alone, as greedy (or
    seeded) sampling is, so the async and synchronous runs must agree."""
    return 100 + (position * 7 + sum(map(ord, req_id))) % 50


@dataclass
class DeviceRunner:
    """The runner's view: host-known tokens from the diffs, plus the token it sampled for each
    request last (on the device), which a pending input token is taken from."""

    eos_at: dict[str, int] = field(default_factory=dict)  # req_id -> output index of EOS
    tokens: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    last_sampled: dict[str, int] = field(default_factory=dict)
    num_prompt: dict[str, int] = field(default_factory=dict)
    num_sampling_steps: dict[str, int] = field(default_factory=dict)
    num_pending_rows: int = 0
    pending_req_ids: set[str] = field(default_factory=set)

    def execute(self, so) -> ModelRunnerOutput:
        for r in so.finished_req_ids | so.preempted_req_ids:
            self.tokens.pop(r, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.num_prompt[new.req_id] = new.num_prompt_tokens
        pending = set()
        for diff in so.scheduled_cached_reqs:
            self.tokens[diff.req_id].extend(diff.new_token_ids)
            assert diff.num_computed_tokens == self.computed[diff.req_id]
            if diff.pending_token:
                pending.add(diff.req_id)
        req_ids, sampled = [], []
        for r, n in so.num_scheduled_tokens.items():
            known = self.tokens[r] + ([self.last_sampled[r]] if r in pending else [])
            end = self.computed[r] + n
            assert end <= len(known), f"{r} runs past its known tokens"
            assert r not in pending or end == len(known), "a pending token is the last"
            self.computed[r] = end
            req_ids.append(r)
            if end == len(known):
                num_out = len(known) - self.num_prompt[r]
                token = EOS if self.eos_at.get(r) == num_out else _token(r, len(known))
                self.last_sampled[r] = token
                self.num_sampling_steps[r] = self.num_sampling_steps.get(r, 0) + 1
                sampled.append([token])
            else:
                sampled.append([])
        self.num_pending_rows += len(pending)
        self.pending_req_ids |= pending
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run(sched, runner, *, overlap: bool, between=None, max_steps: int = 3000):
    """The engine core's loop; ``between(queue)`` runs after each schedule (e.g. an abort)."""
    queue: deque = deque()
    results: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            return results, finish
        while len(queue) < (2 if overlap else 1):
            so = sched.schedule()
            if so.is_empty and queue and not (so.finished_req_ids or so.preempted_req_ids):
                break
            for r in so.num_scheduled_tokens:  # never past what it may still sample
                req = sched.requests[r]
                assert req.num_output_tokens + sched._num_placeholders(req) <= req.max_tokens
            queue.append((so, runner.execute(so)))
            if between is not None:
                between(sched, queue)
            if so.is_empty:
                break
        so, out = queue.popleft()
        for o in sched.update_from_output(so, out):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
        sched.check_invariants()
    raise AssertionError("no progress")


def _scheduler(overlap: bool, **kw):
    sched = make_scheduler(**kw)
    sched.config = replace(sched.config, async_scheduling=overlap)
    return sched


def _add(sched, n: int, eos_at=None, **params) -> None:
    for i in range(n):
        sched.add_request(make_request(f"r{i}", [20 + i] * 3 + list(range(5 + 3 * i)),
                                       max_tokens=5 + i % 4, **params))


@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemption while a step is in flight
def test_outputs_equal_synchronous(num_blocks):
    kw = dict(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_model_len=40)
    eos_at = {"r2": 2, "r5": 0}
    results = {}
    for overlap in (False, True):
        sched, runner = _scheduler(overlap, **kw), DeviceRunner(eos_at=dict(eos_at))
        _add(sched, 8)
        results[overlap] = run(sched, runner, overlap=overlap)
        assert_all_blocks_free(sched)
        if overlap:
            assert runner.num_pending_rows > 0  # steps really overlapped
            if num_blocks == 14:
                assert sched.get_stats().num_preemptions > 0
    assert results[True] == results[False]
    tokens, finish = results[True]
    assert tokens["r2"][-1] == EOS and len(tokens["r2"]) == 3 and finish["r2"] == "stop"
    assert tokens["r5"] == [EOS]
    for i in range(8):  # nothing past max_tokens
        assert len(tokens[f"r{i}"]) <= 5 + i % 4


def test_request_known_finished_is_not_scheduled_again():
    """Its last token (max_tokens) is in flight: no step is scheduled on top of it, so it
    samples exactly max_tokens times."""
    sched, runner = _scheduler(True), DeviceRunner()
    _add(sched, 4)
    tokens, finish = run(sched, runner, overlap=True)
    for i in range(4):
        assert len(tokens[f"r{i}"]) == 5 + i % 4 and finish[f"r{i}"] == "length"
        assert runner.num_sampling_steps[f"r{i}"] == 5 + i % 4
    assert runner.num_pending_rows > 0


def test_step_past_eos_is_discarded_and_blocks_freed():
    """EOS arrives one step late: the step already run on top of it is dropped (its token never
    reaches the output) and the request's blocks are freed when the EOS is applied."""
    sched, runner = _scheduler(True), DeviceRunner(eos_at={"r0": 1})
    sched.add_request(make_request("r0", 6, max_tokens=8))
    tokens, finish = run(sched, runner, overlap=True)
    assert tokens["r0"] == [_token("r0", 6), EOS] and finish["r0"] == "stop"
    assert runner.num_sampling_steps["r0"] == 3  # one past the EOS, discarded
    assert_all_blocks_free(sched)


def test_abort_between_steps_frees_blocks():
    sched, runner = _scheduler(True), DeviceRunner()
    _add(sched, 3)
    aborted = []

    def abort_r1(sched, queue):
        """With two steps of r1 in flight, one of them on a pending token."""
        if (len(queue) == 2 and not aborted and "r1" in queue[0][0].num_scheduled_tokens
                and "r1" in queue[1][0].num_scheduled_tokens):
            used = sched.kv_cache_manager.pool.num_used_blocks
            aborted.extend(sched.abort_requests(["r1"]))
            assert sched.kv_cache_manager.pool.num_used_blocks < used  # freed at once
            aborted.append(sched.requests.get("r1"))

    tokens, finish = run(sched, runner, overlap=True, between=abort_r1)
    assert aborted[0].finish_reason == "abort" and aborted[1] is None
    assert "r1" not in tokens and "r1" not in finish  # nothing of it came out after the abort
    assert len(tokens["r0"]) == 5 and len(tokens["r2"]) == 7
    assert_all_blocks_free(sched)


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.3), dict(presence_penalty=0.5)])
def test_requests_needing_their_token_on_the_host_do_not_overlap(params):
    """Penalties read the output tokens on the host: such a request waits for its token."""
    sched, runner = _scheduler(True), DeviceRunner()
    _add(sched, 2, **params)
    tokens, _ = run(sched, runner, overlap=True)
    assert runner.num_pending_rows == 0
    assert len(tokens["r0"]) == 5


class _AnyGrammar:
    """A grammar that accepts everything: the mask of its next step follows each token."""

    error = None

    def is_ready(self) -> bool:
        return True

    def accept_tokens(self, token_ids: list[int]) -> int:
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def test_request_with_a_grammar_does_not_overlap():
    sched, runner = _scheduler(True), DeviceRunner()
    _add(sched, 2)
    sched.requests["r0"].grammar = _AnyGrammar()
    tokens, _ = run(sched, runner, overlap=True)
    assert runner.num_pending_rows > 0  # r1 overlaps
    assert runner.pending_req_ids == {"r1"}
    assert len(tokens["r0"]) == 5


def test_without_the_flag_a_request_in_flight_waits():
    sched = _scheduler(False)
    _add(sched, 2)
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.schedule().is_empty
