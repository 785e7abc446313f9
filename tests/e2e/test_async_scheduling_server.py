"""--async_scheduling with the engine core in its own process (AsyncLLM, ZMQ): streamed tokens
equal the synchronous offline engine's, and a client that goes away mid-stream (an abort
arriving between steps, with a step in flight) leaves no block held."""

from __future__ import annotations

import asyncio

from bladellm import LLM, SamplingParams
from bladellm.config import EngineConfig
from bladellm.engine.async_llm import AsyncLLM


async def test_streams_equal_offline_and_cancel_frees_blocks(tiny_llama):
    engine = AsyncLLM.from_engine_config(EngineConfig.from_kwargs(
        model=tiny_llama, dtype="float32", block_size=4, debug_block_accounting=True,
        async_scheduling=True))
    try:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=10 + i) for i in range(8)]
        prompts = [list(range(3, 3 + 5 + 2 * i)) for i in range(8)]

        async def run(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(prompts[i], params[i], f"s{i}"):
                tokens += out.outputs[0].token_ids
            return tokens

        got = await asyncio.gather(*(run(i) for i in range(8)))
        offline = LLM(model=tiny_llama, dtype="float32", block_size=4)
        want = [o.outputs[0].token_ids for o in offline.generate(prompts, params,
                                                                 use_tqdm=False)]
        offline.shutdown()
        assert got == want

        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        gen = engine.generate(list(range(3, 40)), long, "to-cancel")
        async for _ in gen:
            break  # the client goes away after the first token
        await gen.aclose()
        for _ in range(100):
            if (await engine.call_utility("get_stats"))[3] == 0:  # num_used_blocks
                break
            await asyncio.sleep(0.05)
        assert (await engine.call_utility("get_stats"))[3] == 0
        assert await engine.call_utility("check_invariants") is True
    finally:
        engine.shutdown()
