"""/v1/chat/completions with --reasoning_parser, over scripted model outputs (the fake engine's
tokens are characters, so any output and any delta boundary can be scripted): the thinking as
reasoning_content and reasoning, non-stream and stream (checked with the openai SDK), usage's
reasoning_tokens, tool calls parsed from the answer only, multi-turn input, and the end-tag ids
that gate a constrained request's grammar."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import FakeAsyncLLM

from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.api_server import build_app
from bladellm.outputs import CompletionOutput, RequestOutput

MSGS = [{"role": "user", "content": "hi"}]


class ScriptedLLM(FakeAsyncLLM):
    """Emits ``script`` (a list of text deltas; one token per character) for every choice,
    then finishes with "stop"; records the messages the template rendered."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script
        self.messages: list[dict] = []
        processor, scripted = self.input_processor, self

        original = processor.apply_chat_template

        def apply(messages, add_generation_prompt=True, **kwargs):
            scripted.messages = messages
            return original(messages, add_generation_prompt, **kwargs)

        processor.apply_chat_template = apply

    async def generate(self, prompt, params, request_id, *, delta=True):
        self.calls.append((prompt, params, request_id))
        ids = prompt if isinstance(prompt, list) else self.model_info.tokenizer.encode(prompt)
        for step, piece in enumerate(self.script):
            last = step == len(self.script) - 1
            outs = [CompletionOutput(j, piece, [ord(c) for c in piece], None,
                                     "stop" if last else None) for j in range(params.n)]
            yield RequestOutput(request_id, None, ids, outs, finished=last)


def _client(engine, **kw) -> httpx.AsyncClient:
    app = build_app(engine, ServerConfig(**kw))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _sdk(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http,
                              max_retries=0)


QWEN_OUT = ["<th", "ink>\nThe user", " says hi.\n</thi", "nk>\n\n", "Hello", "!"]


async def test_non_stream_splits_thinking_under_both_names():
    engine = ScriptedLLM(QWEN_OUT)
    async with _client(engine, reasoning_parser="qwen3") as http:
        r = await http.post("/v1/chat/completions", json={"messages": MSGS, "n": 2})
    body = r.json()
    assert r.status_code == 200, body
    for choice in body["choices"]:
        msg = choice["message"]
        assert msg["content"] == "Hello!"
        assert msg["reasoning_content"] == msg["reasoning"] == "The user says hi."
    text = "".join(QWEN_OUT)
    usage = body["usage"]
    assert usage["completion_tokens"] == 2 * len(text)
    # Tokens from the one completing "<think>" through the one completing "</think>".
    thinking = len("".join(QWEN_OUT[1:4]))
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thinking}


async def test_without_a_parser_nothing_changes():
    engine = ScriptedLLM(QWEN_OUT)
    async with _client(engine) as http:
        body = (await http.post("/v1/chat/completions", json={"messages": MSGS})).json()
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "".join(QWEN_OUT), "refusal": None}
    assert "completion_tokens_details" not in body["usage"]


async def test_qwen3_without_think_tags_is_all_answer():
    engine = ScriptedLLM(["Plain", " answer"])
    async with _client(engine, reasoning_parser="qwen3") as http:
        body = (await http.post("/v1/chat/completions", json={
            "messages": MSGS, "chat_template_kwargs": {"enable_thinking": False}})).json()
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Plain answer" and msg["reasoning_content"] is None
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # chat_template_kwargs reach the template.
    assert engine.input_processor.last_kwargs == {"enable_thinking": False}


async def test_deepseek_r1_thinking_opened_by_the_template():
    engine = ScriptedLLM(["Hmm, ", "let me see", "</think>", "\n\n42"])
    async with _client(engine, reasoning_parser="deepseek_r1") as http:
        body = (await http.post("/v1/chat/completions", json={"messages": MSGS})).json()
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm, let me see", "42")
    # Cut off while thinking: no answer at all.
    engine.script = ["still", " thinking"]
    async with _client(engine, reasoning_parser="deepseek_r1") as http:
        body = (await http.post("/v1/chat/completions", json={"messages": MSGS})).json()
    msg = body["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == ("still thinking", None)


async def test_stream_with_the_openai_sdk():
    engine = ScriptedLLM(QWEN_OUT)
    async with _client(engine, reasoning_parser="qwen3") as http:
        stream = await _sdk(http).chat.completions.create(
            model="fake-model", messages=MSGS, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    thinking, answer, both_names = [], [], True
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        r = getattr(d, "reasoning_content", None)
        if r is not None:
            thinking.append(r)
            both_names &= getattr(d, "reasoning", None) == r
        if d.content:
            answer.append(d.content)
            assert r is None  # thinking and answer never share a delta
    assert "".join(thinking) == "The user says hi." and both_names
    assert "".join(answer) == "Hello!"
    assert not any("<" in t or ">" in t for t in thinking + answer)  # no tag leaked
    assert chunks[-2].choices[0].finish_reason == "stop"
    usage = chunks[-1].usage
    assert usage.completion_tokens_details.reasoning_tokens == len("".join(QWEN_OUT[1:4]))


async def test_tool_calls_are_parsed_from_the_answer_only():
    call = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    decoy = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    engine = ScriptedLLM(["<think>", "maybe ", decoy, "</think>", "\n", call])
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    for stream in (False, True):
        async with _client(engine, reasoning_parser="qwen3") as http:
            sdk = _sdk(http)
            if not stream:
                resp = await sdk.chat.completions.create(model="fake-model", messages=MSGS,
                                                         tools=tools)
                msg = resp.choices[0].message
                assert resp.choices[0].finish_reason == "tool_calls"
                assert [json.loads(c.function.arguments) for c in msg.tool_calls] == \
                    [{"tz": "UTC"}]
                assert msg.reasoning_content == "maybe " + decoy
                continue
            chunks = [c async for c in await sdk.chat.completions.create(
                model="fake-model", messages=MSGS, tools=tools, stream=True)]
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert [json.loads(tc.function.arguments) for tc in calls] == [{"tz": "UTC"}]
        thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                           for c in chunks)
        assert thinking == "maybe " + decoy


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
async def test_multi_turn_thinking_reaches_the_template(name):
    engine = ScriptedLLM(["ok"])
    msgs = [*MSGS, {"role": "assistant", "content": "Hello", name: "greet back"},
            {"role": "user", "content": "again"}]
    async with _client(engine, reasoning_parser="qwen3") as http:
        r = await http.post("/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 200, r.text
        assert engine.messages[1]["reasoning_content"] == "greet back"
        assert name not in engine.messages[1] or name == "reasoning_content"
        bad = [{"role": "user", "content": "x", name: "y"}]
        r = await http.post("/v1/chat/completions", json={"messages": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[0].{name}"
        both = [*MSGS, {"role": "assistant", "content": "a", "reasoning": "p",
                        "reasoning_content": "q"}, {"role": "user", "content": "b"}]
        r = await http.post("/v1/chat/completions", json={"messages": both})
        assert r.status_code == 400


async def test_a_constrained_request_gates_its_grammar_on_the_end_tag():
    engine = ScriptedLLM(["{}"])
    schema = {"type": "object"}
    async with _client(engine, reasoning_parser="deepseek_r1") as http:
        r = await http.post("/v1/chat/completions", json={
            "messages": MSGS, "response_format": {
                "type": "json_schema", "json_schema": {"name": "o", "schema": schema}}})
        assert r.status_code == 200, r.text
        guided = engine.calls[-1][1].guided_decoding
        assert guided.reasoning_end == [ord(c) for c in "</think>"]
        assert guided.reasoning_start is None
    # qwen3's optional thinking needs <think> as one token: not so here, so the grammar runs
    # from the first token.
    async with _client(engine, reasoning_parser="qwen3") as http:
        await http.post("/v1/chat/completions", json={"messages": MSGS, "guided_json": schema})
        assert engine.calls[-1][1].guided_decoding.reasoning_end is None
    async with _client(engine) as http:
        await http.post("/v1/chat/completions", json={"messages": MSGS, "guided_json": schema})
        assert engine.calls[-1][1].guided_decoding.reasoning_end is None
