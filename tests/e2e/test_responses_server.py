"""``/v1/responses`` end to end: the real server with a tiny model, a Qwen3-style template that
opens ``<think>`` at the generation prompt and ``--reasoning_parser qwen3``, driven by the
official ``openai`` client: ``responses.create`` and the ``responses.stream`` helper, which
checks the event order and that each item's id matches the final response.

A random model never closes the think block, so with thinking on all of its output is a
reasoning item; the other tests turn thinking off (``reasoning.effort: "none"`` →
``enable_thinking: false``: the template closes the block) to get an answer."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_reasoning_models import QWEN3_LIKE_TEMPLATE
from test_server import ServerProcess

MAX_MODEL_LEN = 1024
NO_THINKING = {"effort": "none"}
TINY = {"model": "tiny", "reasoning": NO_THINKING}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama", max_position_embeddings=MAX_MODEL_LEN),
        "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", "0",
        "--dtype", "float32", "--max_model_len", str(MAX_MODEL_LEN), "--num_kv_blocks", "256",
        "--block_size", "16", "--disable_access_log", "--num_threads", "1",
        "--reasoning_parser", "qwen3", "--chat_template", QWEN3_LIKE_TEMPLATE,
        "--responses_store_max_entries", "64"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture
def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                              timeout=120)


class Reply(BaseModel):
    answer: Literal["yes", "no"]


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


async def test_create_and_stream_agree(client):
    resp = await client.responses.create(**TINY, input="Tell me a story",
                                         instructions="Be brief.", max_output_tokens=8,
                                         temperature=0)
    assert resp.object == "response" and resp.model == "tiny"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8 and resp.usage.input_tokens > 0
    async with client.responses.stream(**TINY, input="Tell me a story",
                                       instructions="Be brief.", max_output_tokens=8,
                                       temperature=0) as stream:
        events = [e async for e in stream]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == resp.output_text  # greedy: the same text both ways
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}
    assert final.usage.output_tokens == 8


async def test_reasoning_items(client):
    kwargs = dict(model="tiny", input="Think about it", max_output_tokens=8, temperature=0)
    resp = await client.responses.create(**kwargs)
    item, = resp.output  # cut while thinking: the reasoning item, no answer
    assert item.type == "reasoning" and item.status == "incomplete" and item.content[0].text
    assert resp.usage.output_tokens_details.reasoning_tokens == 8
    async with client.responses.stream(**kwargs) as stream:
        events = [e async for e in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == item.content[0].text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].id == done.item_id
    # Sent back, the thinking is rendered into the next turn's prompt.
    base = dict(**TINY, max_output_tokens=1)
    turn = [{"role": "user", "content": "Think about it"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Again"}]
    without = await client.responses.create(input=turn, **base)
    with_it = await client.responses.create(
        input=[turn[0], item.model_dump(exclude_none=True), *turn[1:]], **base)
    assert with_it.usage.input_tokens > without.usage.input_tokens + 4


async def test_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    resp = await client.responses.create(
        **TINY, input="Is the sky blue?", max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema,
                         "strict": True}})
    assert resp.status == "completed"
    assert json.loads(resp.output_text)["answer"] in ("yes", "no")
    # The SDK's parse helper sends a strict schema made from a pydantic model.
    parsed = await client.responses.parse(**TINY, input="Is the sky blue?",
                                          max_output_tokens=64, text_format=Reply)
    assert parsed.output_parsed.answer in ("yes", "no")


async def test_function_call_round_trip(client):
    resp = await client.responses.create(
        **TINY, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call, = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = await client.responses.create(**TINY, input=[result], tools=[WEATHER],
                                            previous_response_id=resp.id,
                                            max_output_tokens=6, temperature=0)
    stateless = await client.responses.create(
        **TINY, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               call.model_dump(exclude_none=True), result])
    assert chained.previous_response_id == resp.id
    assert chained.usage.input_tokens == stateless.usage.input_tokens
    assert chained.output_text == stateless.output_text
    # Streamed, the arguments arrive as deltas that add up to the final call's.
    async with client.responses.stream(
            **TINY, input="Weather in Rome?", tools=[WEATHER], max_output_tokens=64,
            tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == final.output[0].arguments


async def test_store_get_delete(client):
    resp = await client.responses.create(**TINY, input="hi", max_output_tokens=3)
    got = await client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(resp.id)
    await client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)


async def test_errors(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(**TINY, input="x", tools=[{"type": "web_search"}])
    assert "web_search" in err.value.message and err.value.param == "tools[0].type"
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(**TINY, input="x", background=True)
    assert err.value.param == "background"
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(**TINY, input="x", previous_response_id="resp_0")
    assert err.value.code == "previous_response_not_found"
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/responses", json={"model": "tiny", "input": {"no": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = await http.post("/v1/responses", content=b"{not json")
        assert r.status_code == 400
    # and it keeps serving
    assert (await client.responses.create(**TINY, input="x", max_output_tokens=2)).usage


async def _metric(server, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.url + "/metrics")).text
    return float(re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE).group(1))


async def test_disconnect_mid_stream_frees_kv_blocks(server):
    aborted = 'bladellm_request_success_total{finished_reason="abort"}'
    before = await _metric(server, aborted)
    body = {"model": "tiny", "reasoning": NO_THINKING, "input": "Once upon a time", "stream": True,
            "max_output_tokens": MAX_MODEL_LEN - 64}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with http.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while "response.output_text.delta" not in await anext(lines):
                pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if await _metric(server, "bladellm_kv_cache_used_blocks") == 0 and \
                await _metric(server, aborted) == before + 1:
            break
        await asyncio.sleep(0.05)
    assert await _metric(server, "bladellm_kv_cache_used_blocks") == 0
    assert await _metric(server, aborted) == before + 1
