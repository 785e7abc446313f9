"""Structured output and tool calling through the real server with the official ``openai``
client: response_format, guided_* extras, streaming, n > 1, tools (forced and parsed), the
compiled-grammar cache counter and 400s for bad constraints."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from decimal import Decimal

import httpx
import jsonschema
import openai
import pytest

from guided_cases import (
    EMPLOYEE_PROFILE, IPV4_REGEX, PYDANTIC_IGNORED, PYDANTIC_MODELS, PYDANTIC_SCHEMAS, SCHEMAS)
from test_server import ServerProcess

MSGS = [{"role": "user", "content": "Reply in JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess([
        "--model", tiny_model_factory("llama"), "--served_model_name", "tiny",
        "--host", "127.0.0.1", "--port", "0", "--dtype", "float32", "--max_model_len", "512",
        "--num_kv_blocks", "512", "--disable_access_log", "--num_threads", "1",
        "--enable_json_warmup", "--trust_request_chat_template"])  # the tools test sends one
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


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text, parse_float=Decimal), schema)


async def _metric(server, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.url + "/metrics")).text
    return float(re.search(rf"^bladellm_{name} ([0-9.e+-]+)$", text, re.M).group(1))


async def test_response_format_json_schema_and_json_object(client):
    schema = SCHEMAS["recipe"]
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=1, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "recipe", "schema": schema, "strict": True}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        _valid(choice.message.content, schema)
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=300, temperature=0,
        response_format={"type": "json_object"})
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content, parse_float=Decimal), dict)
    else:
        assert choice.finish_reason == "length"


async def test_guided_extras_on_completions_streaming(client):
    text, finish = "", None
    stream = await client.completions.create(
        model="tiny", prompt="Employee:", max_tokens=400, temperature=1.0, seed=5, stream=True,
        extra_body={"guided_json": json.dumps(EMPLOYEE_PROFILE)})
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    _valid(text, EMPLOYEE_PROFILE)
    resp = await client.completions.create(
        model="tiny", prompt="IP:", max_tokens=30, temperature=1.0, n=3,
        extra_body={"guided_regex": IPV4_REGEX})
    for choice in resp.choices:
        assert re.fullmatch(IPV4_REGEX, choice.text, re.ASCII), choice.text
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=10, extra_body={
            "guided_choice": ["alpha", "beta"]})
    assert resp.choices[0].message.content in ("alpha", "beta")
    resp = await client.completions.create(
        model="tiny", prompt="x", max_tokens=10, extra_body={
            "structured_outputs": {"choice": ["one", "two"]}})
    assert resp.choices[0].text in ("one", "two")


async def test_whitespace_pattern(client):
    resp = await client.completions.create(
        model="tiny", prompt="x", max_tokens=200, temperature=1.0, seed=2, extra_body={
            "guided_json": SCHEMAS["flat_object"], "guided_whitespace_pattern": r"[\n ]{0,2}"})
    _valid(resp.choices[0].text, SCHEMAS["flat_object"])


async def test_second_request_with_a_schema_compiles_nothing(server, client):
    schema = {"type": "object", "properties": {"server_only": {"type": "boolean"}},
              "required": ["server_only"], "additionalProperties": False}
    body = dict(model="tiny", prompt="x", max_tokens=20, extra_body={"guided_json": schema})
    await client.completions.create(**body)
    compiles = await _metric(server, "guided_grammar_compiles")
    hits = await _metric(server, "guided_grammar_cache_hits")
    await client.completions.create(**body)
    assert await _metric(server, "guided_grammar_compiles") == compiles
    assert await _metric(server, "guided_grammar_cache_hits") == hits + 1


async def test_forced_tool_calls(client):
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, temperature=1.0, seed=3, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _valid(call.function.arguments, WEATHER)
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=300, temperature=1.0, seed=4, tools=TOOLS,
        tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        params = next(t["function"]["parameters"] for t in TOOLS
                      if t["function"]["name"] == call.function.name)
        _valid(call.function.arguments, params)


async def test_forced_tool_call_streams_argument_deltas(client):
    stream = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, temperature=1.0, seed=6, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    args, names, ids = "", [], set()
    async for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            if delta.id:
                ids.add(delta.id)
                names.append(delta.function.name)
            args += delta.function.arguments or ""
    assert names == ["get_weather"] and len(ids) == 1
    _valid(args, WEATHER)


HERMES = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": 2}}\n</tool_call>')


async def test_auto_tool_choice_parses_hermes_calls(client):
    # The tiny model cannot write a call by itself: a regex makes it write a Hermes call, and
    # tool_choice "auto" (the default with tools) must parse it.
    body = dict(model="tiny", messages=MSGS, max_tokens=80, tools=TOOLS,
                extra_body={"guided_regex": re.escape(HERMES)})
    resp = await client.chat.completions.create(**body)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    content, calls, finish = "", [], None
    async for chunk in await client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]
    # tool_choice "none": the same text stays text.
    resp = await client.chat.completions.create(**body, tool_choice="none")
    assert resp.choices[0].message.content == HERMES and not resp.choices[0].message.tool_calls


async def test_tools_reach_the_chat_template_and_tool_turns_are_accepted(client):
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %}({{ c.function.name }} "
                "{{ c.function.arguments.city }}){% endfor %}\n{% endfor %}")
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    base = dict(model="tiny", messages=msgs, max_tokens=1,
                extra_body={"chat_template_kwargs": {"chat_template": template}})
    without = await client.chat.completions.create(**base)
    with_tools = await client.chat.completions.create(**base, tools=TOOLS)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens


@pytest.mark.parametrize("extra,words", [
    ({"guided_json": {"type": "foo"}}, "Invalid type"),
    # A keyword the grammar cannot enforce is refused only in a strict schema.
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "f", "strict": True, "schema": {"type": "string", "format": "no-such-format"}}}},
     "'format: no-such-format' not supported in a strict schema"),
    ({"guided_regex": "(unclosed"}, "unclosed group"),
    ({"guided_grammar": "start: missing_rule"}, "missing_rule"),
    ({"guided_choice": []}, "non-empty"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "only one"),
    # Grammars that compile but no output can satisfy (they failed at the first token: a 500).
    ({"guided_grammar": "start: start"}, "no output can satisfy"),
    ({"guided_grammar": 'root ::= "a" root'}, "no output can satisfy"),
])
async def test_bad_constraints_are_400_with_the_reason(client, extra, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        await client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                        extra_body=extra)
    # Still serving. ignore_eos: a sampled EOS (finish "stop") made this flaky.
    resp = await client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"


async def test_unsatisfiable_grammar_is_an_invalid_request_naming_the_field(server):
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(server.url + "/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 5, "guided_grammar": "start: start"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_grammar"
    assert error["message"].startswith("guided_grammar: no output can satisfy the grammar")


def _outgrowing_grammar(k: int = 100) -> str:
    """Any run of "a"s, each level of a right recursion through k rules: llguidance's Earley row
    passes its 2000-item limit after ~18 "a"s, i.e. mid-output (the first token is fine)."""
    alts = " | ".join(f'"a" y{i}' for i in range(k))
    return "start: x\nx: \"a\" | " + alts + "\n" + "\n".join(f"y{i}: x" for i in range(k))


@pytest.mark.parametrize("stream", [False, True])
async def test_grammar_failing_mid_output_is_an_invalid_request(server, stream):
    """llguidance giving up after some output is the constraint's doing, with its advice: a 400
    naming the field (in-band when streaming), not a 500."""
    # The grammar may end after any "a": EOS (and the BOS/pad id) banned keeps it going
    # (min_tokens is refused with a grammar).
    body = {"model": "tiny", "prompt": "x", "max_tokens": 64, "temperature": 0,
            "logit_bias": {"0": -100, "2": -100}, "guided_grammar": _outgrowing_grammar(),
            "stream": stream}
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(server.url + "/v1/completions", json=body)
    if stream:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # output came first
    else:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_grammar"
    assert re.match(r"guided_grammar: the grammar constraint failed after \d+ output tokens: "
                    r"Parser Error: Current row has \d+ items; max is 2000", error["message"])
    assert "left-recursive" in error["message"]


@pytest.mark.parametrize("num_choices", [2000, 5000])
async def test_thousands_of_choices(client, num_choices):
    # Each choice was a parser-level alternative: 2000 or more failed with a 500 at the first
    # token (llguidance's Earley row limit).
    choices = [f"option {i}" for i in range(num_choices)]
    resp = await client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=10, extra_body={"guided_choice": choices})
    assert resp.choices[0].message.content in choices


async def test_openai_client_parse_with_a_pydantic_model(client):
    # The client's own structured-output helper: it sends a strict json_schema made from the
    # pydantic model and parses the answer back into it.
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)
        tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)

    resp = await client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=200,
                                               temperature=1.0, seed=11, response_format=Pet)
    pet = resp.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


async def test_schemas_with_unenforceable_keywords(server, client):
    """Non-strict: served, the unenforceable keywords ignored and logged; strict: a 400 naming
    the keyword, as OpenAI answers."""
    schema = PYDANTIC_SCHEMAS["TaggedItem"]  # a pydantic model with set fields: uniqueItems
    fmt = {"type": "json_schema", "json_schema": {"name": "TaggedItem", "schema": schema}}
    for extra in ({"guided_json": schema}, {"response_format": fmt}):
        resp = await client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=150,
                                                    temperature=1.0, seed=3, extra_body=extra)
        PYDANTIC_MODELS["TaggedItem"].model_validate_json(resp.choices[0].message.content)
    assert "uniqueItems" in server.log() and "ignored" in server.log()
    strict = {"type": "json_schema",
              "json_schema": {"name": "TaggedItem", "schema": schema, "strict": True}}
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MSGS, "max_tokens": 5, "response_format": strict})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format" and "'uniqueItems'" in error["message"]
    assert error["type"] == "invalid_request_error"
    # The openai client's parse() sends the model strict: refused the same way.
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        await client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=5,
                                            response_format=PYDANTIC_MODELS["TaggedItem"])
    assert not PYDANTIC_IGNORED["Survey"]
    resp = await client.chat.completions.parse(model="tiny", messages=MSGS, max_tokens=150,
                                               temperature=1.0, seed=5,
                                               response_format=PYDANTIC_MODELS["Survey"])
    assert isinstance(resp.choices[0].message.parsed, PYDANTIC_MODELS["Survey"])
