"""``--scheduling_policy priority`` end to end on a tiny model: through the offline engine (an
urgent request added to a saturated engine finishes first, preempting a running one, and greedy
tokens are those of fcfs) and through the real server with the ``openai`` client."""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from bladellm import LLM, SamplingParams
from bladellm.engine.llm_engine import LLMEngine
from bladellm.config import EngineConfig
from test_server import API_KEY, ServerProcess

ENGINE = dict(dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=32)


def _prompts(n: int) -> list[list[int]]:
    return [[5 + (7 * i + j) % 60 for j in range(6 + 3 * i)] for i in range(n)]


def _run_engine(model: str, policy: str, urgent_priority: int) -> tuple[list[str], dict]:
    """Four long requests (priority 1) on an engine with two sequence slots; after two steps an
    urgent short one (``urgent_priority``). Returns the finish order and every output."""
    kwargs = {"scheduling_policy": policy, **ENGINE}
    engine = LLMEngine(EngineConfig.from_kwargs(model=model, max_num_seqs=2,
                                                debug_block_accounting=True, **kwargs))
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(5)
    for i in range(4):
        engine.add_request(f"long{i}", prompts[i], long, priority=1 if policy == "priority" else 0)
    finished, outputs = [], {}
    for _ in range(2):
        engine.step()
    engine.add_request("urgent", prompts[4], SamplingParams(temperature=0.0, max_tokens=4,
                                                            ignore_eos=True),
                       priority=urgent_priority)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                outputs[out.request_id] = out.outputs[0].token_ids
    stats = engine.core.scheduler.get_stats()
    return finished, {"outputs": outputs, "preemptions": stats.num_preemptions}


def test_urgent_request_preempts_and_finishes_first_with_unchanged_greedy_tokens(tiny_llama):
    order, prio = _run_engine(tiny_llama, "priority", 0)
    assert order[0] == "urgent", order
    assert prio["preemptions"] >= 1  # it took a running request's slot
    fcfs_order, fcfs = _run_engine(tiny_llama, "fcfs", 0)
    assert fcfs_order.index("urgent") >= 2  # behind at least the two running ones
    assert prio["outputs"] == fcfs["outputs"]


def test_offline_generate_takes_priorities(tiny_llama):
    llm = LLM(model=tiny_llama, scheduling_policy="priority", max_num_seqs=1, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = _prompts(4)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2, 0])
    first = [o.metrics.first_token_time for o in outs]
    assert sorted(range(4), key=first.__getitem__) == [3, 1, 2, 0]
    plain = LLM(model=tiny_llama, max_num_seqs=1, **ENGINE)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="^priority: .*--scheduling_policy priority"):
        plain.generate(prompts, params, use_tqdm=False, priority=[0, 0, 1, 0])
    with pytest.raises(ValueError, match="^priority: got 2 for 4 prompts"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests() and not plain.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def priority_server(tiny_llama):
    srv = ServerProcess([
        "--model", tiny_llama, "--served_model_name", "tiny", "--host", "127.0.0.1",
        "--port", "0", "--dtype", "float32", "--max_model_len", "512", "--num_kv_blocks", "256",
        "--api_key", API_KEY, "--disable_access_log", "--shutdown_timeout", "5",
        "--num_threads", "1", "--scheduling_policy", "priority", "--max_num_seqs", "1"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(timeout=30)


async def test_server_serves_the_urgent_request_first(priority_server):
    """One sequence slot, four long low-priority streams: an urgent chat request sent once the
    first stream is running preempts it and finishes before every one of them."""
    client = openai.AsyncOpenAI(base_url=priority_server.url + "/v1", api_key=API_KEY,
                                max_retries=0, timeout=120)
    done: dict[str, float] = {}
    started = asyncio.Event()

    async def low(i: int) -> None:
        stream = await client.completions.create(
            model="tiny", prompt=f"low {i}", max_tokens=480, temperature=0.0, stream=True,
            extra_body={"priority": 5, "ignore_eos": True})
        async for _ in stream:
            started.set()
        done[f"low{i}"] = time.monotonic()

    lows = [asyncio.create_task(low(i)) for i in range(4)]
    await asyncio.wait_for(started.wait(), 60)
    urgent = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "now"}], max_tokens=4,
        temperature=0.0, extra_body={"priority": -1, "ignore_eos": True})
    done["urgent"] = time.monotonic()
    lows_done_before = sorted(k for k in done if k != "urgent")
    await asyncio.gather(*lows)
    assert urgent.choices[0].finish_reason == "length"
    # Nothing low could finish meanwhile: the running one was preempted, the others wait.
    assert lows_done_before == [], done
    with pytest.raises(openai.BadRequestError, match="priority"):
        await client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                        extra_body={"priority": 2**64})
