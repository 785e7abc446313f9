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


def _run(model_dir: str, async_scheduling: bool, params, prompts=None):
    llm = LLM(model=model_dir, async_scheduling=async_scheduling, **STRESS)
    try:
        prompts = prompts or _prompts(llm.engine.model_info.vocab_size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.core.scheduler.get_stats()
        llm.engine.core.scheduler.check_invariants()
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason
                                                          for o in outs], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_equal_synchronous_under_stress(tiny_llama, kind):
    if kind == "greedy":
        params = SamplingParams(temperature=0.0, max_tokens=20)
    else:
        params = [SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20)
                  for i in range(12)]
    sync_ids, sync_reasons, _ = _run(tiny_llama, False, params)
    ids, reasons, stats = _run(tiny_llama, True, params)
    assert ids == sync_ids
    assert reasons == sync_reasons
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the stress really ran
    assert stats.num_used_blocks == 0
