"""Pipeline parallelism's schedule (``EngineCore._pipelined_step``), driven with the fake runner:
up to ``depth`` micro-batches in flight, a request never in two of them, outputs identical to
one step at a time, preemption and aborts while steps are in flight."""

from __future__ import annotations

from collections import deque

import pytest

from test_scheduler import assert_all_blocks_free
from sched_utils import FakeRunner, make_request, make_scheduler, run_to_completion


def _sampler(req_id: str, runner: FakeRunner) -> int:
    state = runner.states[req_id]
    return 100 + (len(state.token_ids) * 7 + sum(map(ord, req_id))) % 50


def _add(sched, n: int) -> None:
    for i in range(n):
        sched.add_request(make_request(f"r{i}", [20 + i] * 3 + list(range(5 + i)),
                                       max_tokens=6 + i % 4))


def run_pipelined(sched, runner, depth: int, on_publish=None, max_steps: int = 2000):
    """The engine core's batch queue, with the fake runner executing each step when it is
    published (real workers run steps in publication order too)."""
    queue: deque = deque()
    results: dict[str, list[int]] = {}
    depths = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            return results, depths
        while len(queue) < depth:
            in_flight = {r for so, _ in queue for r in so.num_scheduled_tokens}
            unfinished = sched.num_running + sched.num_waiting
            so = sched.schedule(skip=in_flight, max_num_reqs=max(1, -(-unfinished // depth)))
            assert not in_flight & set(so.num_scheduled_tokens), "a request in two micro-batches"
            if so.is_empty and queue and not (so.finished_req_ids or so.preempted_req_ids):
                break
            depths.append(len(queue))
            queue.append((so, runner.execute(so)))
            if on_publish is not None:
                on_publish(so)
            if so.is_empty:
                break
        so, out = queue.popleft()
        for o in sched.update_from_output(so, out):
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_invariants()
    raise AssertionError("no progress")


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_blocks", [64, 12])  # 12: preemption while steps are in flight
def test_pipelined_outputs_equal_one_step_at_a_time(depth, num_blocks):
    kw = dict(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_model_len=32)
    ref = make_scheduler(**kw)
    ref_runner = FakeRunner(ref)
    ref_runner.sampler = lambda r: _sampler(r, ref_runner)
    _add(ref, 7)
    want = {r: toks for r, (toks, _) in run_to_completion(ref, ref_runner).items()}

    sched = make_scheduler(**kw)
    runner = FakeRunner(sched)
    runner.sampler = lambda r: _sampler(r, runner)
    _add(sched, 7)
    got, depths = run_pipelined(sched, runner, depth)
    assert got == want
    assert max(depths) == depth - 1  # the pipeline did fill
    if num_blocks == 12:
        assert sched.get_stats().num_preemptions > 0
    assert_all_blocks_free(sched)


def test_micro_batches_split_the_running_requests():
    sched = make_scheduler(max_num_batched_tokens=64)
    _add(sched, 6)
    first = sched.schedule(max_num_reqs=3)
    second = sched.schedule(skip=set(first.num_scheduled_tokens), max_num_reqs=3)
    assert len(first.num_scheduled_tokens) == 3 and len(second.num_scheduled_tokens) == 3
    assert not set(first.num_scheduled_tokens) & set(second.num_scheduled_tokens)
    third = sched.schedule(skip=set(first.num_scheduled_tokens) | set(
        second.num_scheduled_tokens), max_num_reqs=3)
    assert third.is_empty


def test_request_preempted_while_in_flight_is_held_back():
    """A later micro-batch's allocation preempted it while a step of it is in flight: it is
    admitted again only once that step's (ignored) result is back, or the stale result would
    count for the resumed request."""
    sched = make_scheduler(num_blocks=64)
    runner = FakeRunner(sched)
    _add(sched, 2)
    first = sched.schedule()  # both running
    out = runner.execute(first)
    victim = sched.running[-1]
    sched._preempt(victim)  # noqa: SLF001 - as a later micro-batch's allocation would
    sched.running.remove(victim)
    held = sched.schedule(skip={victim.request_id})
    assert victim.request_id not in held.num_scheduled_tokens
    assert sched.waiting[0] is victim
    assert victim.request_id not in sched.schedule().num_scheduled_tokens  # still in flight
    sched.update_from_output(first, out)  # its step is back (its result ignored)
    admitted = sched.schedule()
    assert victim.request_id in admitted.num_scheduled_tokens
