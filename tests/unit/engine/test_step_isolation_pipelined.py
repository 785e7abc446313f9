"""Recovering a failed pipelined micro-batch after the later ones finished
(``StepIsolation.recover(..., in_later_steps)``): requests aborted or preempted since it was
scheduled are not re-run (their blocks are no longer theirs), a request that a later
micro-batch resumed is not dropped from the workers, and the culprit is still found."""

from types import SimpleNamespace

from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.engine.step_isolation import StepIsolation
from bladellm.request import Request, RequestStatus
from bladellm.sampling_params import SamplingParams


def _running(req_id: str) -> Request:
    req = Request(req_id, [5, 6, 7], SamplingParams(max_tokens=4))
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 3  # decoding: not a suspect
    return req


def _setup():
    reqs = {r: _running(r) for r in ("a", "b", "bad", "preempted")}
    reqs["preempted"].status = RequestStatus.PREEMPTED  # by a later micro-batch's schedule
    scheduler = SimpleNamespace(requests=reqs,
                                kv_cache_manager=SimpleNamespace(
                                    get_group_block_ids=lambda _: [[1]]))
    sched = SchedulerOutput(preempted_req_ids={"resumed_later"})
    for req_id in ("a", "aborted", "b", "bad", "preempted"):  # "aborted": gone from requests
        sched.num_scheduled_tokens[req_id] = 1
    return scheduler, sched


def test_recover_skips_gone_requests_and_keeps_later_ones():
    scheduler, sched = _setup()
    runs: list[list[str]] = []
    dropped: list[list[str]] = []

    def run(step: SchedulerOutput) -> ModelRunnerOutput:
        ids = [new.req_id for new in step.scheduled_new_reqs]
        runs.append(ids)
        if "bad" in ids:
            raise RuntimeError("injected fault")
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[9] for _ in ids])

    out = StepIsolation(scheduler, run, dropped.append).recover(
        sched, RuntimeError("injected fault"), in_later_steps={"resumed_later"})
    assert dropped[0] == ["a", "aborted", "b", "bad", "preempted"]  # not "resumed_later"
    assert all(r in ("a", "b", "bad") for ids in runs for r in ids)
    # The full set lost two members, so it is run again rather than assumed to fail.
    assert runs[0] == ["a", "b", "bad"]
    assert dict(zip(out.req_ids, out.sampled_token_ids)) == {"a": [9], "b": [9], "bad": []}
    assert set(out.errored) == {"bad"}


def test_nothing_left_to_run_runs_nothing():
    scheduler, sched = _setup()
    for req in scheduler.requests.values():
        req.status = RequestStatus.PREEMPTED
    runs = []
    out = StepIsolation(scheduler, lambda s: runs.append(s), lambda ids: None).recover(
        sched, RuntimeError("x"))
    assert runs == [] and out.req_ids == [] and not out.errored
