"""Errors of the recovery itself (``StepIsolation.recover``), not of the requests it re-runs: a
rank whose ``drop_requests`` raises, or a re-run that cannot be built, fail the step's requests
not yet answered with an engine error (logged as such) and leave the engine running; a dead
worker still propagates. And the log when every request of the failed step is already gone."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.engine.step_isolation import StepIsolation
from bladellm.request import Request, RequestStatus
from bladellm.sampling_params import SamplingParams


class _Dead(Exception):
    pass


def _setup(names=("a", "b", "bad", "c"), broken_blocks: str | None = None):
    reqs = {}
    for name in names:
        req = Request(name, [5, 6, 7], SamplingParams(max_tokens=4))
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = 3  # decoding: no suspects, the whole step is bisected
        reqs[name] = req

    def blocks(req_id: str) -> list[list[int]]:
        if req_id == broken_blocks:
            raise KeyError(f"no block table for {req_id}")  # an engine bug, not the request's
        return [[1]]

    scheduler = SimpleNamespace(requests=reqs,
                                kv_cache_manager=SimpleNamespace(get_group_block_ids=blocks))
    sched = SchedulerOutput()
    for name in names:
        sched.num_scheduled_tokens[name] = 1
    return scheduler, sched


def _run(runs: list[list[str]]):
    def run(step: SchedulerOutput) -> ModelRunnerOutput:
        ids = [new.req_id for new in step.scheduled_new_reqs]
        runs.append(ids)
        if "bad" in ids:
            raise RuntimeError("injected fault")
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[9] for _ in ids])
    return run


def _results(out: ModelRunnerOutput) -> dict[str, list[int]]:
    return dict(zip(out.req_ids, out.sampled_token_ids))


def test_first_drop_raising_fails_the_step_not_the_engine(caplog):
    scheduler, sched = _setup()
    runs: list[list[str]] = []

    def drop(ids: list[str]) -> None:
        raise RuntimeError("rank 1: drop failed")

    with caplog.at_level(logging.ERROR):
        out = StepIsolation(scheduler, _run(runs), drop, fatal=(_Dead,)).recover(
            sched, RuntimeError("injected fault"))
    assert runs == []  # the workers' view is unknown: nothing is re-run on it
    assert set(out.errored) == {"a", "b", "bad", "c"}
    assert all("engine error" in e and "drop failed" in e for e in out.errored.values())
    assert "engine error while re-running a failed step" in caplog.text


def test_drop_after_a_failed_group_raising_keeps_what_already_ran():
    scheduler, sched = _setup()
    runs: list[list[str]] = []
    drops: list[list[str]] = []

    def drop(ids: list[str]) -> None:
        drops.append(ids)
        if len(drops) > 1:  # the drop after a failed re-run group
            raise RuntimeError("rank 0: drop failed")

    out = StepIsolation(scheduler, _run(runs), drop, fatal=(_Dead,)).recover(
        sched, RuntimeError("injected fault"))
    # a, b ran in the first half; "bad", c failed together and their drop raised.
    assert runs == [["a", "b"], ["bad", "c"]]
    assert _results(out) == {"a": [9], "b": [9], "bad": [], "c": []}
    assert set(out.errored) == {"bad", "c"}
    assert all("engine error" in e for e in out.errored.values())


def test_dead_worker_during_drop_still_propagates():
    scheduler, sched = _setup()

    def drop(ids: list[str]) -> None:
        raise _Dead("worker died")

    with pytest.raises(_Dead):
        StepIsolation(scheduler, _run([]), drop, fatal=(_Dead,)).recover(
            sched, RuntimeError("injected fault"))


def test_a_re_run_that_cannot_be_built_is_not_blamed_on_its_requests(caplog):
    scheduler, sched = _setup(broken_blocks="c")
    runs: list[list[str]] = []
    with caplog.at_level(logging.ERROR):
        out = StepIsolation(scheduler, _run(runs), lambda ids: None, fatal=(_Dead,)).recover(
            sched, RuntimeError("injected fault"))
    # The first half runs; building the second (holding c) fails before anything is run:
    # nobody is called a culprit, the unanswered requests fail with the engine's error.
    assert runs == [["a", "b"]]
    assert _results(out) == {"a": [9], "b": [9], "bad": [], "c": []}
    assert set(out.errored) == {"bad", "c"}
    assert all("engine error" in e and "KeyError" in e for e in out.errored.values())
    assert "fails the step" not in caplog.text  # no request named as the cause
    assert "engine error while re-running a failed step" in caplog.text


def test_all_requests_gone_says_so(caplog):
    scheduler, sched = _setup()
    for req in scheduler.requests.values():
        req.status = RequestStatus.PREEMPTED
    with caplog.at_level(logging.WARNING):
        out = StepIsolation(scheduler, _run([]), lambda ids: None).recover(
            sched, RuntimeError("x"))
    assert out.req_ids == []
    assert "were all gone" in caplog.text and "none failed" not in caplog.text
