"""/v1/responses over the fake engine, driven by the official ``openai`` SDK in process (its
``responses.stream`` helper checks the event order and that item ids match the final response)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
from fake_engine import FakeAsyncLLM
from test_lifecycle_api import _call

from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.api_server import build_app
from bladellm.outputs import CompletionOutput, RequestOutput


class ScriptedEngine(FakeAsyncLLM):
    """Writes ``script`` (a list of text deltas, one token each), then stops (or hits the
    token limit first, like a real engine)."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script

    async def generate(self, prompt, params, request_id, *, delta=True, priority=0):
        self.calls.append((prompt, params, request_id))
        self.priorities.append(priority)
        ids = self.input_processor.process(request_id, prompt, params, 0.0,
                                           validate_grammar=False)[0].prompt_token_ids
        limit = params.max_tokens or 10_000
        for step, text in enumerate(self.script[:limit]):
            last = step == len(self.script) - 1 or step == limit - 1
            reason = None if not last else ("length" if step == limit - 1 and
                                            step < len(self.script) - 1 else "stop")
            yield RequestOutput(request_id, None, ids,
                                [CompletionOutput(0, text, [1000 + step], None, reason)],
                                finished=last)


def _sdk(app) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                              max_retries=0), http


@pytest.fixture
def fake():
    engine = FakeAsyncLLM()
    engine.eos_after_tokens = 4
    return engine


async def test_text_plain_and_streamed_agree(fake):
    client, _ = _sdk(build_app(fake, ServerConfig()))
    resp = await client.responses.create(model="fake-model", input="hi", instructions="be brief",
                                         temperature=0.5, top_p=0.9, metadata={"k": "v"})
    assert resp.status == "completed" and resp.output_text == "abcd"
    assert resp.id.startswith("resp_") and resp.output[0].id.startswith("msg_")
    assert resp.usage.output_tokens == 4 and resp.usage.total_tokens == \
        resp.usage.input_tokens + 4
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert resp.metadata == {"k": "v"} and resp.temperature == 0.5
    prompt, params, _ = fake.calls[-1]
    assert prompt == fake.model_info.tokenizer.encode("<system>be brief<user>hi<assistant>",
                                                      add_special_tokens=False)
    assert params.temperature == 0.5 and params.top_p == 0.9
    async with client.responses.stream(model="fake-model", input="hi") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 4,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = final.output[0].id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
    assert events[-1].response.output[0].id == item_id and final.output_text == "abcd"


async def test_max_output_tokens_is_incomplete(fake):
    client, http = _sdk(build_app(fake, ServerConfig()))
    resp = await client.responses.create(input="hi", max_output_tokens=2)
    assert resp.status == "incomplete" and resp.output_text == "ab"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"
    body = {"input": "hi", "max_output_tokens": 2, "stream": True}
    r = await http.post("/v1/responses", json=body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "event: response.incomplete" in r.text


async def test_json_schema_goes_to_structured_output(fake):
    client, _ = _sdk(build_app(fake, ServerConfig()))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    resp = await client.responses.create(input="x", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert resp.text.format.type == "json_schema"
    guided = fake.calls[-1][1].guided_decoding
    assert guided is not None and json.loads(guided.json) == schema
    await client.responses.create(input="x", text={"format": {"type": "json_object"}})
    assert fake.calls[-1][1].guided_decoding.json_object
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(input="x", text={"format": {"type": "json_schema",
                                                                  "name": "n"}})
    assert err.value.body["param"] == "text.format.schema"


async def test_store_get_delete_cancel_and_previous_response(fake):
    client, http = _sdk(build_app(fake, ServerConfig()))
    first = await client.responses.create(input="hi")
    got = await client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "abcd"
    second = await client.responses.create(input="more", previous_response_id=first.id,
                                           instructions="new rules")
    assert second.previous_response_id == first.id
    assert fake.calls[-1][0] == fake.model_info.tokenizer.encode(
        "<system>new rules<user>hi<assistant>abcd<user>more<assistant>", add_special_tokens=False)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.cancel(first.id)
    assert "background" in err.value.message
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(input="x", previous_response_id=first.id)
    assert err.value.body["code"] == "previous_response_not_found"
    unstored = await client.responses.create(input="hi", store=False)
    assert unstored.store is False
    assert (await http.get(f"/v1/responses/{unstored.id}")).status_code == 404


async def test_input_items_of_a_chain(fake):
    client, http = _sdk(build_app(fake, ServerConfig()))
    first = await client.responses.create(input="hi")
    second = await client.responses.create(
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "more"}]}])
    page = await client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in page.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert page.data[0].content[0].text == "hi" and page.data[1].id == first.output[0].id
    assert page.data[2].content[0].text == "more"
    newest = await client.responses.input_items.list(second.id, limit=1)
    assert newest.has_more and newest.data[0].id == page.data[2].id
    rest = await client.responses.input_items.list(second.id, limit=5, after=newest.last_id)
    assert [i.id for i in rest.data] == [page.data[1].id, page.data[0].id]
    assert not rest.has_more
    r = await http.get(f"/v1/responses/{second.id}/input_items", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = await http.get("/v1/responses/nope/input_items")
    assert r.status_code == 404


async def test_store_is_bounded(fake):
    client, http = _sdk(build_app(fake, ServerConfig(responses_store_max_entries=2)))
    ids = [(await client.responses.create(input="hi")).id for _ in range(3)]
    codes = [(await http.get(f"/v1/responses/{i}")).status_code for i in ids]
    assert codes == [404, 200, 200]


def test_store_flags_are_validated():
    with pytest.raises(ValueError, match="--responses_store_ttl"):
        ServerConfig(responses_store_ttl=0)
    with pytest.raises(ValueError, match="--responses_store_max_entries"):
        ServerConfig(responses_store_max_entries=-1)


async def test_function_call_round_trip():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    engine = ScriptedEngine(["Let me check. ", call[:20], call[20:]])
    client, _ = _sdk(build_app(engine, ServerConfig()))
    tools = [{"type": "function", "name": "get_weather", "description": "weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    resp = await client.responses.create(input="weather in Paris?", tools=tools)
    message, fc = resp.output
    assert message.type == "message" and message.content[0].text == "Let me check. "
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.id.startswith("fc_")
    assert json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id.startswith("call_")
    async with client.responses.stream(model="fake-model", input="weather in Paris?",
                                       tools=tools) as stream:
        types = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert types.index("response.function_call_arguments.done") < types.index(
        "response.completed")
    assert final.output[1].type == "function_call"
    # The result goes back with previous_response_id, and statelessly with the items.
    engine.script = ["Sunny."]
    result = {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21C"}
    follow = await client.responses.create(input=[result], previous_response_id=resp.id,
                                           tools=tools)
    assert follow.output_text == "Sunny."
    with_history = engine.calls[-1][0]
    stateless = [{"role": "user", "content": "weather in Paris?"},
                 *[item.model_dump(exclude_none=True) for item in resp.output], result]
    await client.responses.create(input=stateless, tools=tools)
    assert engine.calls[-1][0] == with_history
    rendered = engine.model_info.tokenizer.decode(with_history)
    assert "<tool>sunny, 21C" in rendered


async def test_named_tool_choice_streams_arguments(fake):
    client, _ = _sdk(build_app(fake, ServerConfig()))
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    async with client.responses.stream(model="fake-model", input="x", tools=tools,
                                       tool_choice={"type": "function", "name": "f"}) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == "abcd" == final.output[0].arguments
    assert json.loads(fake.calls[-1][1].guided_decoding.json) == {"type": "object"}


async def test_reasoning_items():
    engine = ScriptedEngine(["I should", " greet.", "</think>", "\n\nHello", "!"])
    client, _ = _sdk(build_app(engine, ServerConfig(reasoning_parser="deepseek_r1")))
    resp = await client.responses.create(input="hi")
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I should greet."
    assert message.content[0].text == "Hello!"
    assert resp.usage.output_tokens_details.reasoning_tokens == 3  # up to the answer
    with pytest.raises(openai.BadRequestError) as err:  # the thinking is not answer text
        await client.responses.create(input="hi", top_logprobs=1)
    assert err.value.param == "top_logprobs"
    async with client.responses.stream(model="fake-model", input="hi") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    types = [e.type for e in events]
    assert types[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == "I should greet." and done.item_id == final.output[0].id
    # Sent back, the output items are the earlier assistant turn (test_responses_input.py checks
    # that the reasoning item becomes its reasoning_content).
    engine.script = ["</think>ok"]
    await client.responses.create(input=[{"role": "user", "content": "hi"},
                                         *[i.model_dump(exclude_none=True)
                                           for i in resp.output],
                                         {"role": "user", "content": "again"}])
    assert "Hello!" in engine.model_info.tokenizer.decode(engine.calls[-1][0])


async def test_logprobs(fake):
    client, http = _sdk(build_app(fake, ServerConfig()))
    resp = await client.responses.create(input="x", top_logprobs=2,
                                         include=["message.output_text.logprobs"])
    lps = resp.output[0].content[0].logprobs
    assert [lp.token for lp in lps] == list("abcd") and fake.calls[-1][1].logprobs == 2
    assert lps[1].logprob == -2.0 and [t.token for t in lps[1].top_logprobs] == ["a", "b"]
    assert lps[0].bytes == [ord("a")]
    async with client.responses.stream(model="fake-model", input="x",
                                       include=["message.output_text.logprobs"]) as stream:
        events = [e async for e in stream]
    deltas = [lp.token for e in events if e.type == "response.output_text.delta"
              for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == [lp.token for lp in done.logprobs] == list("abcd")
    assert all(not lp.top_logprobs for lp in done.logprobs)  # top_logprobs unset: 0
    plain = await client.responses.create(input="x")
    assert plain.output[0].content[0].logprobs == [] and fake.calls[-1][1].logprobs is None
    tools = [{"type": "function", "name": "f"}]
    for body, param in [({"input": "x", "top_logprobs": 21}, "top_logprobs"),
                        ({"input": "x", "top_logprobs": 1, "tools": tools}, "top_logprobs"),
                        ({"input": "x", "tools": tools,
                          "include": ["message.output_text.logprobs"]}, "include")]:
        r = await http.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_priority_reaches_the_engine(fake):
    client, _ = _sdk(build_app(fake, ServerConfig()))
    with pytest.raises(openai.BadRequestError) as err:  # fcfs: only the default priority
        await client.responses.create(input="x", extra_body={"priority": -3})
    assert err.value.param == "priority"
    fake.input_processor.priority_scheduling = True  # --scheduling_policy priority
    resp = await client.responses.create(input="x", extra_body={"priority": -3})
    assert fake.priorities[-1] == -3 and resp.model_extra["priority"] == -3
    await client.responses.create(input="x")
    assert fake.priorities[-1] == 0


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "code_interpreter", "container": {}}]}, 400,
     "tools[0].type"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": 5}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [{"type": "bogus"}]}, 400, "input"),
    # A text-only model: the image part is named (the same loader as chat's image_url).
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "input[0].content[0].type"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x" * 300}, 400, "input"),
    ({"input": "x", "max_output_tokens": 1000}, 400, "max_output_tokens"),
    ({"input": "x", "unknown_field": 1}, 400, "unknown_field"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, 400, "tool_choice.type"),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "strict": True,
                                        "schema": {"type": "array", "uniqueItems": True}}}},
     400, "text.format"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata"),
    # Numbers the engine cannot hold, or not strict JSON numbers (issue 37's boundary rule).
    ({"input": "x", "max_output_tokens": "5"}, 400, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 2**63}, 400, "top_logprobs"),
    ({"input": "x", "temperature": True}, 400, "temperature"),
    ({"input": "x", "priority": 2**64}, 400, "priority"),
])
async def test_bad_requests_get_openai_errors(fake, body, status, param):
    _, http = _sdk(build_app(fake, ServerConfig()))
    r = await http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert not fake.calls or status == 400 and param in ("input", "max_output_tokens")


async def test_dead_engine_is_503_but_stored_responses_stay_readable(fake):
    client, http = _sdk(build_app(fake, ServerConfig()))
    resp = await client.responses.create(input="hi")
    fake.dead_reason = "gone"
    r = await http.post("/v1/responses", json={"input": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert (await client.responses.retrieve(resp.id)).output_text == "abcd"


async def test_unknown_response_ids_are_404(fake):
    _, http = _sdk(build_app(fake, ServerConfig()))
    for method, path in [("GET", "/v1/responses/x"), ("DELETE", "/v1/responses/x"),
                         ("POST", "/v1/responses/x/cancel")]:
        r = await http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


async def test_openapi_declares_the_request_body(fake):
    _, http = _sdk(build_app(fake, ServerConfig()))
    spec = (await http.get("/openapi.json")).json()
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "input" in spec["components"]["schemas"]["ResponsesRequest"]["properties"]


async def test_engine_failure_mid_stream_is_response_failed(fake):
    fake.fail_after_tokens = 2
    _, http = _sdk(build_app(fake, ServerConfig()))
    r = await http.post("/v1/responses", json={"input": "x", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-6:] == [
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert events[-1]["response"]["status"] == "failed"


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_aborts_the_request(stream):
    engine = FakeAsyncLLM(step_delay=0.005)
    app = build_app(engine, ServerConfig())
    gone = asyncio.Event()

    async def leave_after_first_token():
        await engine.started.wait()
        gone.set()

    leaver = asyncio.ensure_future(leave_after_first_token())
    await _call(app, "/v1/responses", {"input": "x", "max_output_tokens": 100,
                                       "stream": stream}, gone)
    await leaver
    (_, _, request_id), = engine.calls
    assert engine.aborted == [request_id] and not engine.active


async def test_client_gone_mid_upload_is_not_a_server_error(fake, caplog):
    app = build_app(fake, ServerConfig())
    parts = [{"type": "http.request", "body": b'{"input": "x", ', "more_body": True},
             {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/responses",
             "raw_path": b"/v1/responses", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", b"1000")],
             "client": ("127.0.0.1", 5000), "server": ("t", 80)}
    with caplog.at_level(logging.DEBUG):
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    assert sent[0]["status"] < 500 and not fake.calls
    assert "Traceback" not in caplog.text


async def test_body_is_parsed_off_the_event_loop(fake, monkeypatch):
    """POST /v1/responses goes through the app's ``serve`` like every other POST: its body is
    parsed (and bounded) in a worker thread, not on the event loop."""
    import threading

    from bladellm.entrypoints.openai import body_bounds
    from bladellm.entrypoints.openai.protocol_responses import ResponsesRequest

    parsed: list[tuple[type, int]] = []
    real = body_bounds._parse

    def spy(model_cls, body, bounds):
        parsed.append((model_cls, threading.get_ident()))
        return real(model_cls, body, bounds)

    monkeypatch.setattr(body_bounds, "_parse", spy)
    _, http = _sdk(build_app(fake, ServerConfig()))
    r = await http.post("/v1/responses", json={"model": "fake-model", "input": "hi"})
    assert r.status_code == 200, r.text
    assert [cls for cls, _ in parsed] == [ResponsesRequest]
    assert parsed[0][1] != threading.get_ident()
    r = await http.post("/v1/responses", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
