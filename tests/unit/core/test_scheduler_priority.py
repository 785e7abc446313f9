"""``--scheduling_policy priority`` on a real Scheduler with a small fake KV pool: admission by
(priority, arrival), preemption of the lowest-priority running request (latest arrival among
equals) when blocks or sequence slots run out, the aging bound on starvation, and fcfs
unchanged."""

from __future__ import annotations

import random

import pytest

from bladellm.config import CacheConfig, SchedulerConfig
from bladellm.core.request_queue import FCFSQueue, PriorityQueue, make_queue
from bladellm.core.scheduler import Scheduler
from bladellm.request import RequestStatus
from sched_utils import EOS, FakeRunner, make_request, run_to_completion, step

STRICT = 1e9  # an aging interval no test outlives: strict priority


def make_scheduler(policy: str = "priority", *, aging: float = STRICT, num_blocks: int = 64,
                   block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64) -> Scheduler:
    kw = {"priority_aging_interval": aging} if policy == "priority" else {}
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          scheduling_policy=policy, **kw)
    return Scheduler(cfg, CacheConfig(block_size=block_size, disable_prompt_cache=True),
                     num_blocks, min(64, (num_blocks - 1) * block_size), eos_token_ids=(EOS,))


def request(req_id: str, prompt: int, priority: int = 0, arrival: float = 0.0,
            max_tokens: int = 4):
    req = make_request(req_id, prompt, max_tokens=max_tokens, arrival_time=arrival)
    req.priority = priority
    return req


def admission_order(sched: Scheduler, runner: FakeRunner) -> list[str]:
    order = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            return order
        so, _ = step(sched, runner)
        order += [n.req_id for n in so.scheduled_new_reqs]
    raise AssertionError("no progress")


# ---- admission order ----------------------------------------------------------------------------

def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    for req_id, prio, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0),
                                  ("e", -1, 4.0)]:
        sched.add_request(request(req_id, 3, prio, arrival))
    assert admission_order(sched, FakeRunner(sched)) == ["e", "b", "d", "c", "a"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    sched = make_scheduler("fcfs", max_num_seqs=1)
    assert isinstance(sched.waiting, FCFSQueue) and not sched.priority
    for req_id, prio, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0)]:
        sched.add_request(request(req_id, 3, prio, arrival))
    assert admission_order(sched, FakeRunner(sched)) == ["a", "b", "c"]


def test_fcfs_still_preempts_the_newest_admitted():
    sched = make_scheduler("fcfs", num_blocks=7, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    sched.add_request(request("old", 8, max_tokens=20))
    step(sched, runner)
    sched.add_request(request("new", 8, max_tokens=20))
    step(sched, runner)  # 2 + 2 blocks of 6 usable
    for _ in range(8):  # each needs a third block, then a fourth
        so, _ = step(sched, runner)
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"new"}
    assert set(run_to_completion(sched, runner)) == {"old", "new"}


# ---- preemption -----------------------------------------------------------------------------------

def _fill(sched: Scheduler, runner: FakeRunner, reqs) -> None:
    for req in reqs:
        sched.add_request(req)
    step(sched, runner)
    assert all(r.status == RequestStatus.RUNNING for r in reqs) and sched.num_waiting == 0


def test_urgent_arrival_preempts_the_lowest_priority_running_request():
    # 9 usable blocks of 4 tokens; three requests of 8 tokens + 1 decode hold 3 blocks each.
    sched = make_scheduler(num_blocks=10, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    _fill(sched, runner, [request("mid", 8, 1, 0.0, max_tokens=6),
                          request("low", 8, 5, 1.0, max_tokens=6),
                          request("hi", 8, 0, 2.0, max_tokens=6)])
    assert [r.request_id for r in sched.running] == ["hi", "mid", "low"]
    step(sched, runner)  # each now holds 3 blocks: the pool is full
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    low_blocks = len(sched.kv_cache_manager.get_block_ids("low"))
    sched.add_request(request("urgent", 8, 0, 3.0, max_tokens=2))
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"low"}
    # "low" was granted its decode token before "urgent" was considered: that grant is gone.
    assert "low" not in so.num_scheduled_tokens
    assert "low" not in {c.req_id for c in so.scheduled_cached_reqs}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["urgent"]
    low = sched.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("low") == [] and low_blocks == 3
    results = run_to_completion(sched, runner)
    assert set(results) == {"urgent", "hi", "mid", "low"}
    assert len(results["low"][0]) == 4  # its 6 tokens, two before the preemption
    assert sched.kv_cache_manager.pool.num_used_blocks == 0


def test_among_equal_priorities_the_latest_arrival_is_preempted():
    sched = make_scheduler(num_blocks=10)
    runner = FakeRunner(sched)
    _fill(sched, runner, [request("first", 8, 3, 0.0, max_tokens=6),
                          request("second", 8, 3, 1.0, max_tokens=6),
                          request("top", 8, 1, 2.0, max_tokens=6)])
    step(sched, runner)
    sched.add_request(request("urgent", 8, 2, 3.0))
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"second"}


def test_a_lower_priority_arrival_waits_instead_of_preempting():
    sched = make_scheduler(num_blocks=10)
    runner = FakeRunner(sched)
    _fill(sched, runner, [request(f"r{i}", 8, 1, float(i), max_tokens=6) for i in range(3)])
    step(sched, runner)
    sched.add_request(request("later", 8, 1, 9.0))  # equal priority, later: waits its turn
    sched.add_request(request("lowest", 8, 7, 10.0))
    so, _ = step(sched, runner)
    assert not so.preempted_req_ids and not so.scheduled_new_reqs
    assert sched.num_waiting == 2


def test_urgent_arrival_preempts_for_a_sequence_slot():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    _fill(sched, runner, [request("a", 3, 4, 0.0, max_tokens=8),
                          request("b", 3, 4, 1.0, max_tokens=8)])
    sched.add_request(request("urgent", 3, 0, 2.0, max_tokens=2))
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == {"b"}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["urgent"]
    assert so.num_scheduled_tokens == {"a": 1, "urgent": 3}  # b's grant was taken back
    assert set(run_to_completion(sched, runner)) == {"a", "b", "urgent"}


def test_greedy_tokens_do_not_depend_on_priorities():
    """The same requests with and without priorities (and the preemptions they cause) produce
    the same tokens: the runner's tokens are a function of each request's own prefix."""
    def run(priorities):
        sched = make_scheduler(num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3)
        runner = FakeRunner(sched, sampler=None)
        runner.sampler = lambda req_id: 3 + (sched.requests[req_id].num_tokens * 7
                                             + sum(sched.requests[req_id].all_token_ids)) % 50
        for i, prio in enumerate(priorities):
            sched.add_request(request(f"r{i}", 5 + 3 * i, prio, float(i), max_tokens=10))
        results = run_to_completion(sched, runner)
        return {k: v[0] for k, v in results.items()}, sched.num_preemptions

    plain, _ = run([0] * 6)
    mixed, num_preemptions = run([5, 0, 3, 0, 9, 1])
    assert mixed == plain
    assert num_preemptions > 0  # the comparison covered recompute after preemption


# ---- starvation bound ------------------------------------------------------------------------------

def test_aging_bounds_how_long_urgent_arrivals_can_pass_a_waiting_request():
    """Interval 10 s: a priority-2 request that arrived at t=0 is passed by priority-0
    requests arriving before t=20, never by one arriving after."""
    sched = make_scheduler(aging=10.0, max_num_seqs=1)
    sched.add_request(request("old", 3, 2, 0.0))
    for i, arrival in enumerate([5.0, 12.0, 19.5, 20.5, 30.0]):
        sched.add_request(request(f"new{i}@{arrival:g}", 3, 0, arrival))
    assert admission_order(sched, FakeRunner(sched)) == [
        "new0@5", "new1@12", "new2@19.5", "old", "new3@20.5", "new4@30"]


def test_without_aging_a_low_priority_request_waits_for_every_urgent_one():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(request("old", 3, 2, 0.0))
    for i in range(4):
        sched.add_request(request(f"new{i}", 3, 0, 100.0 * (i + 1)))
    assert admission_order(sched, FakeRunner(sched))[-1] == "old"


@pytest.mark.parametrize("seed", range(4))
def test_no_waiting_request_is_passed_by_one_with_a_larger_key(seed):
    """Requests arriving over time with random priorities and lengths in a tight pool: every
    admission takes the smallest key among the waiting, and every preemption for a waiting
    request takes a larger key than the request it made room for."""
    rng = random.Random(seed)
    now = [0.0]
    sched = make_scheduler(aging=5.0, num_blocks=14, max_num_batched_tokens=12,
                           max_num_seqs=4)
    runner = FakeRunner(sched)
    pending = [request(f"r{i}", rng.randrange(2, 14), rng.randrange(0, 4), float(i),
                       max_tokens=rng.randrange(1, 8)) for i in range(30)]
    for _ in range(1000):
        while pending and pending[0].arrival_time <= now[0]:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        waiting_before = {r.request_id: r.schedule_key for r in sched.waiting}
        so, _ = step(sched, runner)
        admitted = [n.req_id for n in so.scheduled_new_reqs]
        still_waiting = {r.request_id: r.schedule_key for r in sched.waiting}
        for req_id in admitted:
            key = waiting_before[req_id]
            passed = [w for w, k in still_waiting.items()
                      if k < key and w in waiting_before]
            assert not passed, f"{req_id} admitted before {passed}"
        if admitted and so.preempted_req_ids:  # preempted to make room for an admission
            for victim in so.preempted_req_ids:
                assert sched.requests[victim].schedule_key > min(
                    waiting_before[r] for r in admitted)
        assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
        assert [r.schedule_key for r in sched.running] == sorted(
            r.schedule_key for r in sched.running)
        now[0] += 1.0
    else:
        raise AssertionError("no progress")
    assert sched.kv_cache_manager.pool.num_used_blocks == 0


# ---- config and queues ---------------------------------------------------------------------------

def test_config_validation_names_the_flags():
    with pytest.raises(ValueError, match="^--scheduling_policy:"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="^--priority_aging_interval:"):
        SchedulerConfig(scheduling_policy="priority", priority_aging_interval=0)
    with pytest.raises(ValueError, match="^--priority_aging_interval:"):
        SchedulerConfig(scheduling_policy="priority", priority_aging_interval=float("inf"))
    with pytest.raises(ValueError, match="^--priority_aging_interval: only used with "
                                         "--scheduling_policy priority"):
        SchedulerConfig(priority_aging_interval=5.0)
    assert SchedulerConfig(scheduling_policy="priority").priority_scheduling


def test_queues_share_one_interface():
    assert isinstance(make_queue("priority"), PriorityQueue)
    for policy in ("fcfs", "priority"):
        queue = make_queue(policy)
        reqs = [request(f"r{i}", 2, p, float(i)) for i, p in enumerate([1, 0, 1])]
        for seq, req in enumerate(reqs):
            req.schedule_key = (req.priority * 100 + req.arrival_time, seq)
            queue.add(req)
        assert len(queue) == 3 and queue
        first = queue.pop()
        assert first.request_id == ("r0" if policy == "fcfs" else "r1")
        queue.prepend([first])
        assert queue.peek() is first
        queue.remove({"r2"})
        assert sorted(r.request_id for r in queue) == ["r0", "r1"]
