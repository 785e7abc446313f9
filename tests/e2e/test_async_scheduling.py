"""--async_scheduling on a tiny model (CPU): step n + 1 is scheduled and launched before step
n's sampled ids are read, its decode rows gathering their input token from step n's sampled-id
tensor. The outputs must equal those of the synchronous engine under the stress configuration
(continuous batching, chunked prefill, prompt cache, a KV pool small enough to preempt)."""

from __future__ import annotations

import random

import pytest

from bladellm import LLM, SamplingParams

STRESS = dict(dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=48, max_model_len=160, debug_block_accounting=True)


def _prompts(vocab_size: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(33)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 50))]
        prompts.append((shared[: rng.choice([0, 9, 33])] if i % 3 else []) + tail)
    return prompts


@pytest.fixture
def pending_rows(monkeypatch):
    """Counts the input tokens taken from a previous step's sampled ids (so a test cannot pass
    with the overlap silently off)."""
    from bladellm.worker.input_batch import InputBatch

    count = [0]
    fill = InputBatch.fill_pending

    def counting(self, inputs):
        count[0] += sum(len(dst) for _, _, dst in inputs.pending or ())
        return fill(self, inputs)

    monkeypatch.setattr(InputBatch, "fill_pending", counting)
    return count


def _run(model_dir: str, async_scheduling: bool, params, prompts=None, full=False):
    llm = LLM(model=model_dir, async_scheduling=async_scheduling, **STRESS)
    try:
        prompts = prompts or _prompts(llm.engine.model_info.vocab_size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
        llm.engine.core.scheduler.check_invariants()
        if full:
            return outs, stats
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason
                                                          for o in outs], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_equal_synchronous_under_stress(tiny_llama, kind, pending_rows):
    if kind == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=20)
    else:
        params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20)
                  for i in range(12)]
    sync_ids, sync_reasons, _ = _run(tiny_llama, False, params)
    assert pending_rows[0] == 0
    ids, reasons, stats = _run(tiny_llama, True, params)
    assert pending_rows[0] > 100  # decode rows really took their token from the device
    assert ids == sync_ids
    assert reasons == sync_reasons
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the stress really ran
    assert stats.num_used_blocks == 0


def test_stops_and_limits_equal_synchronous(tiny_llama, pending_rows):
    """Stop tokens, EOS (min_tokens), stop strings, logprobs and penalties (which wait for
    their token on the host) mixed in one batch: the same outputs, nothing past a stop."""
    sync_outs, _ = _run(tiny_llama, False, SamplingParams(temperature=0.0, max_tokens=16),
                        full=True)
    params = []
    for i, out in enumerate(sync_outs):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=16,
                                         stop_token_ids=[ids[5]]))
        elif kind == 1 and len(text) > 8:
            params.append(SamplingParams(temperature=0.0, max_tokens=16, stop=[text[4:7]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=3 + i, logprobs=2,
                                         min_tokens=2))
        else:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=12,
                                         repetition_penalty=1.2, presence_penalty=0.3))
    want, _ = _run(tiny_llama, False, params, full=True)
    got, stats = _run(tiny_llama, True, params, full=True)
    assert pending_rows[0] > 0
    for w, g, p in zip(want, got, params):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert len(g.outputs[0].token_ids) <= p.max_tokens
        if p.stop_token_ids and g.outputs[0].finish_reason == "stop":
            assert g.outputs[0].token_ids[-1] in p.stop_token_ids
            assert p.stop_token_ids[0] not in g.outputs[0].token_ids[:-1]
        if p.logprobs:  # the batches differ (fp32 sums in another order): close, same ranks
            for gs, ws in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                assert [(t.token_id, t.rank) for t in gs] == [(t.token_id, t.rank) for t in ws]
                assert [t.logprob for t in gs] == pytest.approx([t.logprob for t in ws],
                                                                abs=1e-4)
    assert stats.num_used_blocks == 0


def test_abort_between_steps_frees_blocks(tiny_llama):
    llm = LLM(model=tiny_llama, async_scheduling=True, **STRESS)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i] * (6 + i), params)
        seen: dict[str, int] = {}
        for _ in range(4):
            for out in engine.step():
                seen[out.request_id] = len(out.outputs[0].token_ids)
        assert len(engine.core.batch_queue) == 1  # a step is in flight as we abort
        engine.abort_request("r1")
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id != "r1", "output after the abort"
                seen[out.request_id] = len(out.outputs[0].token_ids)
        assert seen["r0"] == seen["r2"] == 40
        assert engine.core.scheduler.get_stats().num_used_blocks == 0
        engine.core.scheduler.check_invariants()
    finally:
        llm.shutdown()


def test_pending_tokens_reach_the_cuda_graph_buffers(tiny_llama, pending_rows):
    """Decode steps padded through the CUDA graphs' static buffers (the CPU check of what a
    graph replays, worker/cuda_graphs.py): the pending tokens are written before the copy into
    them, so the outputs still equal the synchronous engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sync_ids, _, _ = _run(tiny_llama, False, params)
    llm = LLM(model=tiny_llama, async_scheduling=True, **STRESS)
    try:
        runner = llm.engine.core.executor.worker.model_runner
        runner.use_padded_eager_steps([1, 3, 5, 8])
        outs = llm.generate(_prompts(llm.engine.model_info.vocab_size), params, use_tqdm=False)
        assert runner.graphs.num_padded_reqs > 0 and pending_rows[0] > 0
        assert [o.outputs[0].token_ids for o in outs] == sync_ids
        assert llm.engine.core.scheduler.get_stats().num_used_blocks == 0
    finally:
        llm.shutdown()
