"""AsyncLLM with the engine core in its own process (ZMQ + msgpack)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from bladellm import SamplingParams
from bladellm.config import EngineConfig
from bladellm.engine.async_llm import AsyncLLM
from bladellm.errors import EngineDeadError, EngineOverloadedError


def _engine(model_dir: str, **kw) -> AsyncLLM:
    return AsyncLLM.from_engine_config(EngineConfig.from_kwargs(
        model=model_dir, dtype="float32", block_size=4, debug_block_accounting=True, **kw))


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    eng = _engine(tiny_model_factory("llama"))
    yield eng
    eng.shutdown()
    assert not eng.client.proc.is_alive()


async def _used_blocks(engine: AsyncLLM) -> int:
    stats = await engine.call_utility("get_stats")
    return stats[3]  # SchedulerStats is array-like: field 3 = num_used_blocks


async def test_streams_tokens_and_matches_offline(engine, tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    deltas, text = [], ""
    async for out in engine.generate([5, 6, 7, 8], params, "r1"):
        deltas.append(out.outputs[0].token_ids)
        text += out.outputs[0].text
    assert all(len(d) == 1 for d in deltas) and len(deltas) == 16
    assert out.finished and out.outputs[0].finish_reason == "length"
    from bladellm import LLM
    offline = LLM(model=tiny_llama, dtype="float32").generate([[5, 6, 7, 8]], params,
                                                             use_tqdm=False)[0]
    assert sum(deltas, []) == offline.outputs[0].token_ids
    assert text == offline.outputs[0].text


async def test_concurrent_requests_and_cancel_frees_blocks(engine):
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)

    async def run(i: int) -> int:
        n = 0
        async for out in engine.generate(list(range(3, 3 + 5 + i)), params, f"c{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    counts = await asyncio.gather(*(run(i) for i in range(16)))
    assert counts == [12] * 16

    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    gen = engine.generate(list(range(3, 40)), long, "to-cancel")
    async for _ in gen:
        break  # the client goes away after the first token
    await gen.aclose()
    for _ in range(100):
        if await _used_blocks(engine) == 0:
            break
        await asyncio.sleep(0.05)
    assert await _used_blocks(engine) == 0
    assert await engine.call_utility("check_invariants") is True


async def test_bad_input_raises_value_error(engine):
    with pytest.raises(ValueError):
        async for _ in engine.generate(list(range(3, 3 + 600)), SamplingParams(), "too-long"):
            pass


async def test_queue_full_raises_overloaded(tiny_llama):
    eng = _engine(tiny_llama, max_queue_size=1, max_num_seqs=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        first = eng.generate([5, 6, 7], params, "a")
        await first.__anext__()  # "a" is running; its first token has arrived
        second = eng.generate([5, 6, 8], params, "b")
        task = asyncio.ensure_future(second.__anext__())  # "b" waits behind "a"
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError):
            async for _ in eng.generate([5, 6, 9], params, "c"):
                pass
        task.cancel()
        await first.aclose()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("how", ["raise", "kill"])
async def test_dead_engine_fails_requests_instead_of_hanging(tiny_llama, how):
    eng = _engine(tiny_llama)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        gen = eng.generate([5, 6, 7], params, "victim")
        await gen.__anext__()
        if how == "raise":
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(eng.call_utility("raise", "test"), 10)
        else:
            os.kill(eng.client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(gen), 10)
        assert eng.is_dead
        with pytest.raises(EngineDeadError):
            await eng.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate([5], SamplingParams(max_tokens=2), "after"):
                pass
    finally:
        eng.shutdown()


async def _drain(gen) -> None:
    async for _ in gen:
        pass


async def test_prompt_logprobs_on_the_first_delta_only(engine, tiny_llama):
    """SamplingParams.prompt_logprobs through the engine-core process: the numbers of the
    offline API, sent once with delta outputs, on every output without."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    outs = [out async for out in engine.generate([5, 6, 7, 8], params, "plp-delta")]
    assert outs[0].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in outs[1:])
    finals = [out async for out in engine.generate([5, 6, 7, 8], params, "plp-full",
                                                   delta=False)]
    assert all(out.prompt_logprobs == outs[0].prompt_logprobs for out in finals)
    from bladellm import LLM
    (offline,) = LLM(model=tiny_llama, dtype="float32").generate([[5, 6, 7, 8]], params,
                                                                use_tqdm=False)
    got, want = outs[0].prompt_logprobs, offline.prompt_logprobs
    assert len(got) == 4 and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert [e.token_id for e in g] == [e.token_id for e in w]
        assert [e.logprob for e in g] == pytest.approx([e.logprob for e in w], abs=1e-5)
        assert g[0].rank == w[0].rank
    # n = 2: the same prompt logprobs (the first sample's; batched beside its sibling, so
    # within float tolerance), once.
    two = params.clone(n=2, temperature=0.8, seed=1)
    outs2 = [out async for out in engine.generate([5, 6, 7, 8], two, "plp-two")]
    got2 = outs2[0].prompt_logprobs
    assert len(got2) == 4 and got2[0] is None
    for g, w in zip(got2[1:], got[1:]):
        assert [e.token_id for e in g] == [e.token_id for e in w]
        assert [e.logprob for e in g] == pytest.approx([e.logprob for e in w], abs=1e-5)
    assert all(out.prompt_logprobs is None for out in outs2[1:])
