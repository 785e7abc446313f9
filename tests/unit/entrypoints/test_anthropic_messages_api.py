"""/v1/messages and /v1/messages/count_tokens over the ASGI app with a scripted engine, driven
by the official ``anthropic`` client (its own HTTP stack, on an ASGI transport)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import pytest
from fake_engine import FakeAsyncLLM

from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.api_server import build_app
from bladellm.errors import EngineOverloadedError
from bladellm.outputs import CompletionOutput, RequestOutput

KEY = "sk-test"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}}}


class ScriptedEngine(FakeAsyncLLM):
    """Generates ``script`` (one output per piece), then finishes with ``finish`` /
    ``stop_reason``; without a script, the fake engine's letters."""

    def __init__(self) -> None:
        super().__init__()
        self.model_info.max_model_len = 4096  # room for a thinking budget (>= 1024)
        self.script: list[str] | None = None
        self.finish, self.stop_reason = "stop", None

    async def generate(self, prompt, params, request_id, *, delta=True):
        if self.script is None:
            async for out in super().generate(prompt, params, request_id, delta=delta):
                yield out
            return
        self.calls.append((prompt, params, request_id))
        ids = list(prompt)
        for k, piece in enumerate(self.script):
            last = k == len(self.script) - 1
            yield RequestOutput(request_id, None, ids, [CompletionOutput(
                0, piece, [ord(c) for c in piece], None, self.finish if last else None,
                self.stop_reason if last else None)], finished=last, num_cached_tokens=2)
            await asyncio.sleep(0)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def http(engine):
    app = build_app(engine, ServerConfig(api_key=KEY, max_request_body_bytes="4096"))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://t") as client:
        yield client


@pytest.fixture
def client(http) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(api_key=KEY, base_url="http://t", http_client=http,
                                    max_retries=0)


async def _events(http, body: dict) -> list[tuple[str, dict]]:
    r = await http.post("/v1/messages", json={**body, "stream": True},
                        headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


# ------------------------------------------------------------------------------ happy paths


async def test_create_and_count_tokens(client, engine):
    msg = await client.messages.create(model="fake-model", max_tokens=4, system="Be brief.",
                                       messages=HI)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "abcd"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
    prompt = engine.calls[-1][0]
    # The prefix-cache hits are Anthropic's cache reads; the prompt is their sum.
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)
    assert msg.usage.cache_read_input_tokens == 1
    count = await client.messages.count_tokens(model="fake-model", system="Be brief.",
                                               messages=HI)
    assert count.input_tokens == len(prompt)
    # Sampling parameters reach the engine.
    await client.messages.create(model="fake-model", max_tokens=3, messages=HI,
                                 stop_sequences=["zz"],
                                 extra_body={"temperature": 0.0, "top_k": 5, "top_p": 0.5})
    params = engine.calls[-1][1]
    assert (params.max_tokens, params.stop, params.temperature, params.top_k, params.top_p) \
        == (3, ["zz"], 0.0, 5, 0.5)


async def test_stream_helper(client, engine):
    async with client.messages.stream(model="fake-model", max_tokens=5, messages=HI) as stream:
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "abcde" == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5


async def test_event_sequence(http, engine):
    events = await _events(http, {"model": "fake-model", "max_tokens": 3, "messages": HI})
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["stop_reason"] is None and start["content"] == []
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3


async def test_stop_sequence(client, engine):
    engine.script, engine.stop_reason = ["Hello", " world"], "END"
    msg = await client.messages.create(model="fake-model", max_tokens=20, messages=HI,
                                       stop_sequences=["END"])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "END")
    engine.stop_reason = 1  # the EOS token
    msg = await client.messages.create(model="fake-model", max_tokens=20, messages=HI)
    assert (msg.stop_reason, msg.stop_sequence, msg.content[0].text) == \
        ("end_turn", None, "Hello world")


async def test_auto_tool_call(client, engine):
    engine.script = ["Let me check. ", '<tool_call>{"name": "get_weather", ',
                     '"arguments": {"city": "Paris"}}</tool_call>']
    msg = await client.messages.create(model="fake-model", max_tokens=50, messages=HI,
                                       tools=[WEATHER])
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[1].input == {"city": "Paris"} and msg.stop_reason == "tool_use"
    async with client.messages.stream(model="fake-model", max_tokens=50, messages=HI,
                                      tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check. "
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


async def test_forced_tool_streams_its_input(http, client, engine):
    engine.script = ['{"city"', ': "Ro', 'me"}']
    body = {"model": "fake-model", "max_tokens": 50, "messages": HI, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = await _events(http, body)
    start = next(e for k, e in events if k == "content_block_start")["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather"
    assert start["input"] == {}
    parts = [e["delta"]["partial_json"] for k, e in events if k == "content_block_delta"]
    assert parts == engine.script
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The schema reached the engine as the constraint, and the SDK parses the whole call.
    assert json.loads(engine.calls[-1][1].guided_decoding.json) == WEATHER["input_schema"]
    msg = await client.messages.create(**body)
    assert [(b.type, b.input) for b in msg.content] == [("tool_use", {"city": "Rome"})]


async def test_any_tool_sends_whole_calls(client, engine):
    engine.script = ['[{"name": "get_weather", "parameters": {"city": "A"}}, ',
                     '{"name": "get_weather", "parameters": {"city": "B"}}]']
    async with client.messages.stream(model="fake-model", max_tokens=50, messages=HI,
                                      tools=[WEATHER], tool_choice={"type": "any"}) as stream:
        final = await stream.get_final_message()
    assert [b.input for b in final.content] == [{"city": "A"}, {"city": "B"}]
    assert len({b.id for b in final.content}) == 2 and final.stop_reason == "tool_use"


async def test_max_tokens_beyond_the_context_is_lowered_to_fit():
    engine = FakeAsyncLLM()  # a 128-token context
    app = build_app(engine, ServerConfig())
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://t") as http:
        client = anthropic.AsyncAnthropic(api_key="x", base_url="http://t", http_client=http,
                                          max_retries=0)
        msg = await client.messages.create(model="fake-model", max_tokens=20000, messages=HI)
        prompt = len(engine.calls[-1][0])
        assert engine.calls[-1][1].max_tokens == 128 - prompt
        assert msg.stop_reason == "model_context_window_exceeded"
        assert msg.usage.output_tokens == 128 - prompt
        async with client.messages.stream(model="fake-model", max_tokens=20000,
                                          messages=HI) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "model_context_window_exceeded"
        # Within the context, max_tokens is the client's own limit.
        msg = await client.messages.create(model="fake-model", max_tokens=5, messages=HI)
        assert msg.stop_reason == "max_tokens"
        # A prompt that leaves no room for output is still a 400.
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(model="fake-model", max_tokens=5, messages=[
                {"role": "user", "content": "x" * 200}])
        assert "messages" in info.value.body["error"]["message"]


async def test_thinking_flag_reaches_the_template(client, engine):
    await client.messages.create(model="fake-model", max_tokens=2000, messages=HI,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert engine.input_processor.last_kwargs["enable_thinking"] is True


# ----------------------------------------------------------------------------------- errors


async def test_errors_in_anthropic_shape(client, http, engine):
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model="fake-model", max_tokens=0, messages=HI)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="claude-nope", max_tokens=5, messages=HI)
    assert info.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.AsyncAnthropic(api_key="wrong", base_url="http://t", http_client=http,
                                   max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        await bad.messages.count_tokens(model="fake-model", messages=HI)
    assert info.value.body["error"]["type"] == "authentication_error"
    # Over the body limit: 413, still Anthropic's shape.
    r = await http.post("/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "fake-model", "max_tokens": 5,
        "messages": [{"role": "user", "content": "x" * 5000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = await http.post("/v1/messages", headers={"x-api-key": KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    for field, value in (("max_tokens", "5"), ("max_tokens", 2**40), ("top_k", 2**63),
                         ("temperature", True)):  # strict numbers the engine can hold
        body = {"model": "fake-model", "max_tokens": 5, "messages": HI, field: value}
        r = await http.post("/v1/messages", headers={"x-api-key": KEY}, json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert field in r.json()["error"]["message"], r.json()
    r = await http.post("/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                         "data": ""}}]}]})
    assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"]
    # A full queue is Anthropic's 529 overloaded_error.
    engine.raise_on_generate = EngineOverloadedError("the waiting queue is full")
    with pytest.raises(anthropic.OverloadedError) as info:
        await client.messages.create(model="fake-model", max_tokens=5, messages=HI)
    assert info.value.body["error"]["type"] == "overloaded_error"


async def test_stopping_server_and_dead_engine_are_503_api_error(engine):
    app = build_app(engine, ServerConfig(api_key=KEY))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://t") as http:
        client = anthropic.AsyncAnthropic(api_key=KEY, base_url="http://t", http_client=http,
                                          max_retries=0)
        engine.dead_reason = "the core crashed"
        with pytest.raises(anthropic.ServiceUnavailableError) as info:
            await client.messages.create(model="fake-model", max_tokens=5, messages=HI)
        assert info.value.body["error"]["type"] == "api_error"
        assert info.value.response.headers["retry-after"] == "1"
        engine.dead_reason = None
        app.state.lifecycle.draining = True  # SIGTERM: the middleware refuses new requests
        with pytest.raises(anthropic.ServiceUnavailableError) as info:
            await client.messages.count_tokens(model="fake-model", messages=HI)
        assert info.value.body["type"] == "error"
        assert "shutting down" in info.value.body["error"]["message"]


async def test_other_paths_keep_openai_errors(http):
    r = await http.post("/v1/chat/completions", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 400 and "type" not in r.json() and "error" in r.json()


async def test_mid_stream_failure_is_an_error_event(http, engine):
    engine.fail_after_tokens = 2
    events = await _events(http, {"model": "fake-model", "max_tokens": 8, "messages": HI})
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [k for k, _ in events]


async def test_bearer_and_x_api_key_both_accepted(http):
    body = {"model": "fake-model", "messages": HI}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        r = await http.post("/v1/messages/count_tokens", json=body,
                            headers={**headers, "anthropic-version": "2023-06-01"})
        assert r.status_code == 200, r.text
    r = await http.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # The header works on every /v1 route (the same check), a wrong one nowhere.
    assert (await http.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
    r = await http.get("/v1/models", headers={"x-api-key": KEY + "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_openapi_declares_the_bodies(http):
    spec = (await http.get("/openapi.json")).json()
    op = spec["paths"]["/v1/messages"]["post"]
    props = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert {"model", "messages", "max_tokens", "tools", "thinking", "stream"} <= set(props)
    assert "count_tokens" in "".join(spec["paths"])


# ------------------------------------------------------------------------------ disconnects


async def _leave_early(engine: FakeAsyncLLM, stream: bool) -> list[dict]:
    """POST /v1/messages and disconnect at the first token (streamed: the first text_delta
    sent; not streamed: the engine's first token). httpx's ASGI transport sends the whole body
    and waits for the whole answer, so the app is driven by hand."""
    app = build_app(engine, ServerConfig())
    sent: list[dict] = []
    gone = asyncio.Event()
    body = json.dumps({"model": "fake-model", "max_tokens": 100, "stream": stream,
                       "messages": HI}).encode()
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if requests:
            return requests.pop()
        if not stream:
            await engine.started.wait()
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if b"text_delta" in message.get("body", b""):
            gone.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80),
             "client": ("c", 1)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts(stream):
    engine = FakeAsyncLLM(step_delay=0.01)
    sent = await _leave_early(engine, stream)
    assert engine.aborted and not engine.active and not engine.completed
    if not stream:
        assert sent[0]["status"] == 499  # nobody reads it: the server's "client closed"


async def test_pings_while_the_engine_is_silent(http, engine, monkeypatch):
    from bladellm.entrypoints.anthropic import streaming

    monkeypatch.setattr(streaming, "PING_INTERVAL", 0.01)
    engine.step_delay = 0.1
    events = await _events(http, {"model": "fake-model", "max_tokens": 3, "messages": HI})
    kinds = [k for k, _ in events]
    assert kinds.count("ping") > 2 and kinds[-1] == "message_stop"
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert text == "abc"


# --------------------------------------------------------------------------------- thinking


@pytest.fixture
async def reasoning_client(engine):
    app = build_app(engine, ServerConfig(reasoning_parser="qwen3"))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://t") as http:
        yield anthropic.AsyncAnthropic(api_key="none", base_url="http://t", http_client=http,
                                       max_retries=0)


async def test_thinking_blocks(reasoning_client, engine):
    engine.script = ["<thi", "nk>\nLet me ", "think.\n</th", "ink>\n\nHello", " there"]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    msg = await reasoning_client.messages.create(model="fake-model", max_tokens=2000,
                                                 messages=HI, thinking=thinking)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think." and msg.content[0].signature
    assert msg.content[1].text == "Hello there" and msg.stop_reason == "end_turn"
    async with reasoning_client.messages.stream(model="fake-model", max_tokens=2000,
                                                messages=HI, thinking=thinking) as stream:
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    # display "omitted": the block and its signature, not the text.
    omitted = {**thinking, "display": "omitted"}
    msg = await reasoning_client.messages.create(model="fake-model", max_tokens=2000,
                                                 messages=HI, thinking=omitted)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == ""
    async with reasoning_client.messages.stream(model="fake-model", max_tokens=2000,
                                                messages=HI, thinking=omitted) as stream:
        final = await stream.get_final_message()
    assert final.content[0].thinking == "" and final.content[1].text == "Hello there"


async def test_thinking_then_tool_use(reasoning_client, engine):
    engine.script = ["<think>I need the weather.</think>",
                     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                     "</tool_call>"]
    async with reasoning_client.messages.stream(model="fake-model", max_tokens=100,
                                                messages=HI, tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
    # The thinking of that turn comes back with the tool result; it is not shown again.
    follow_up = [*HI, final.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": final.content[1].id, "content": "cold"}]}]
    engine.script = ["<think>ok</think>It is cold."]
    msg = await reasoning_client.messages.create(model="fake-model", max_tokens=100,
                                                 messages=follow_up, tools=[WEATHER])
    assert msg.content[-1].text == "It is cold."
    prompt = "".join(chr(i) for i in engine.calls[-1][0])
    assert "I need the weather." not in prompt and "cold" in prompt
