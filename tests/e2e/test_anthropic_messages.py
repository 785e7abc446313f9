"""Anthropic's Messages API end to end: the real server with a tiny model, driven by the official
``anthropic`` client (and httpx where the client hides the wire). One server for the module."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import anthropic
import httpx
import pytest

from test_server import ServerProcess, _metric

KEY = "e2e-anthropic-key"
MAX_MODEL_LEN = 1024
GREEDY = {"temperature": 0.0}  # not a keyword of this SDK version's create(): sent as extra
HI = [{"role": "user", "content": "Tell me about the weather."}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city.", "input_schema": CITY}]
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama", max_position_embeddings=MAX_MODEL_LEN),
        "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", "0",
        "--dtype", "float32", "--max_model_len", str(MAX_MODEL_LEN), "--num_kv_blocks", "512",
        "--api_key", KEY, "--disable_access_log", "--num_threads", "1"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture
def client(server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0,
                                    timeout=120)


async def test_create_stream_and_count_tokens_agree(client):
    body = dict(model="tiny", max_tokens=12, system="You are terse.", messages=HI,
                extra_body=GREEDY)
    msg = await client.messages.create(**body)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    text = msg.content[0].text if msg.content else ""
    # Greedy and deterministic: either the budget ran out or the model ended its turn.
    assert (msg.stop_reason, msg.usage.output_tokens == 12) in (
        ("max_tokens", True), ("end_turn", False))
    async with client.messages.stream(**body) as stream:
        streamed = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert streamed == text == (final.content[0].text if final.content else "")
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # count_tokens is the prompt the engine saw: its uncached part plus the prefix-cache hits.
    count = await client.messages.count_tokens(model="tiny", system="You are terse.",
                                               messages=HI)
    for usage in (msg.usage, final.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == count.input_tokens
    assert final.usage.cache_read_input_tokens > 0  # the second run hit the prefix cache


async def test_stop_sequence(client):
    body = dict(model="tiny", max_tokens=16, messages=HI, extra_body=GREEDY)
    text = (await client.messages.create(**body)).content[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    msg = await client.messages.create(**body, stop_sequences=[stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == text[:text.find(stop)]


async def test_tool_use_round_trip(client):
    msg = await client.messages.create(model="tiny", max_tokens=60, messages=HI, tools=TOOLS,
                                       tool_choice=FORCED, extra_body=GREEDY)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in CITY["properties"]["city"]["enum"]
    assert 1 <= call.input["days"] <= 7
    # Streamed: the same call, its input assembled by the SDK from input_json_delta events.
    async with client.messages.stream(model="tiny", max_tokens=60, messages=HI, tools=TOOLS,
                                      tool_choice=FORCED, extra_body=GREEDY) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == call.input
    # The result goes back; the model answers in text (tool_choice auto by default).
    follow_up = [*HI, msg.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}]}]
    answer = await client.messages.create(model="tiny", max_tokens=8, messages=follow_up,
                                          tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("max_tokens", "end_turn")
    count = await client.messages.count_tokens(model="tiny", messages=follow_up, tools=TOOLS)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens \
        == count.input_tokens


async def test_errors_through_the_sdk(server, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # no room left for output
        await client.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": "hello " * MAX_MODEL_LEN}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="claude-opus", max_tokens=8, messages=HI)
    bad = anthropic.AsyncAnthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        await bad.messages.create(model="tiny", max_tokens=8, messages=HI)
    assert info.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": info.value.body["error"]["message"]}}


async def test_x_api_key(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": HI}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        ok = await http.post("/v1/messages", json=body, headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01"})
        assert ok.status_code == 200 and ok.json()["type"] == "message"
        bad = await http.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert bad.status_code == 401
        assert bad.json()["error"]["type"] == "authentication_error"


async def test_disconnect_mid_stream_frees_kv_blocks(server):
    async def metrics() -> str:
        async with httpx.AsyncClient() as http:
            return (await http.get(server.url + "/metrics")).text

    aborted = 'bladellm_request_success_total{finished_reason="abort"}'
    before = _metric(await metrics(), aborted)
    body = {"model": "tiny", "max_tokens": MAX_MODEL_LEN - 64, "stream": True, "messages": HI}
    async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                 headers={"x-api-key": KEY}) as http:
        async with http.stream("POST", "/v1/messages", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while "content_block_delta" not in await anext(lines):
                pass
        # Leaving the block closed the connection at the first token.
    deadline = time.monotonic() + 20
    while True:
        after = await metrics()
        if (_metric(after, aborted) > before
                and _metric(after, "bladellm_kv_cache_used_blocks") == 0) \
                or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert _metric(after, aborted) == before + 1
    assert _metric(after, "bladellm_kv_cache_used_blocks") == 0
