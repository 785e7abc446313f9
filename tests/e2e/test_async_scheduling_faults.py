"""A failed step under --async_scheduling fails only its culprit, like the synchronous engine
(tests/e2e/test_reliability_step.py): whether the step raises when it is launched (on a CPU, the
whole forward) or only when its sampled ids are read (a device error surfaces there), after the
next step was already launched on its pending tokens. That next step's work for the failed
step's requests is dropped and redone; the others get exactly their synchronous tokens."""

from __future__ import annotations

import pytest
import torch
from test_reliability_step import inject_decode_fault

from bladellm import LLM, SamplingParams
from bladellm.worker.model_runner import ModelRunner
from bladellm.worker.step_output import DeferredOutput

NUM = 12
CULPRIT = 5


@pytest.fixture(scope="module")
def llms(tiny_llama):
    kw = dict(model=tiny_llama, dtype="float32", block_size=4, max_num_seqs=16,
              max_num_batched_tokens=256, debug_block_accounting=True)
    sync, overlap = LLM(**kw), LLM(async_scheduling=True, **kw)
    yield sync, overlap
    sync.shutdown()
    overlap.shutdown()


def _prompts() -> list[list[int]]:
    return [[5 + (i * 7 + j) % 300 for j in range(6 + i % 9)] for i in range(NUM)]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, temperature=0.8, seed=1000 + i, ignore_eos=True)
            for i in range(NUM)]


def _check(outs, reference, error: str, llm) -> None:
    for i, out in enumerate(outs):
        if i == CULPRIT:
            assert out.error is not None and error in out.error, out
            assert len(out.outputs[0].token_ids) == 3  # its tokens before the fault
        else:
            assert out.error is None, (i, out.error)
            assert out.outputs[0].token_ids == reference[i].outputs[0].token_ids, i
    scheduler = llm.engine.core.scheduler
    assert not scheduler.has_unfinished_requests() and not llm.engine.core.batch_queue
    scheduler.check_invariants()
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0


def test_fault_at_launch(llms, monkeypatch):
    sync, overlap = llms
    reference = sync.generate(_prompts(), _params(), use_tqdm=False)
    inject_decode_fault(monkeypatch, seed=1000 + CULPRIT)
    _check(overlap.generate(_prompts(), _params(), use_tqdm=False), reference,
           "injected fault", overlap)


def test_fault_when_sampled_ids_are_read(llms, monkeypatch):
    """A one-off device fault: a step's sampled ids are garbage and reading them raises, while
    the next step, already launched, took them as its pending tokens. That step's work for
    them is dropped and redone; the re-run of the failed step succeeds (the fault does not
    repeat), so nobody fails and every request gets its synchronous tokens."""
    sync, overlap = llms
    reference = sync.generate(_prompts(), _params(), use_tqdm=False)
    original = ModelRunner.execute_model_async
    num_steps = [0]
    in_flight_at_fault = []

    def faulty(self, sched):
        handle = original(self, sched)
        num_steps[0] += 1
        if num_steps[0] != 6:  # a decode step of every request
            return handle
        ib = self.input_batch
        with torch.inference_mode():
            ib._sampled[ib._step_no].fill_(3)  # what the next step gathers its inputs from

        def fail():
            in_flight_at_fault.append(len(overlap.engine.core.batch_queue))
            raise RuntimeError("injected read fault")
        return DeferredOutput(fail)

    monkeypatch.setattr(ModelRunner, "execute_model_async", faulty)
    outs = overlap.generate(_prompts(), _params(), use_tqdm=False)
    assert in_flight_at_fault == [1]  # the next step was in flight when the fault surfaced
    for i, out in enumerate(outs):
        assert out.error is None, (i, out.error)
        assert out.outputs[0].token_ids == reference[i].outputs[0].token_ids, i
    scheduler = overlap.engine.core.scheduler
    scheduler.check_invariants()
    assert scheduler.kv_cache_manager.pool.num_used_blocks == 0
