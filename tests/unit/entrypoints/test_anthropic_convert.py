"""An Anthropic Messages request as the chat request the chat machinery serves, and the output
as Anthropic's blocks (no server, no engine)."""

from __future__ import annotations

import json

import pytest

from bladellm.entrypoints.anthropic.convert import to_chat_request
from bladellm.entrypoints.anthropic.output import answer_blocks, stop_reason
from bladellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from bladellm.entrypoints.anthropic.routes import inline_schema
from bladellm.entrypoints.openai.tool_calls import parse_tool_choice
from bladellm.http.errors import APIError

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def _req(**kw) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **kw})


def _plain(chat) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_system_text_and_sampling_fields():
    chat = to_chat_request(_req(system=[{"type": "text", "text": "Be terse."}],
                                temperature=0.5, top_k=3, top_p=0.9, stop_sequences=["END"]))
    assert _plain(chat) == [
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.top_p, chat.stop) == \
        (16, 0.5, 3, 0.9, ["END"])
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_tool_round_trip_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "let me see", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom",
             "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat = to_chat_request(_req(messages=messages, tools=[WEATHER]))
    plain = _plain(chat)
    # Thinking of an earlier turn is dropped; the call's input is the template's arguments.
    assert plain[1] == {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
                        "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                            "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert plain[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert plain[3] == {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"}
    assert plain[4] == {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["input_schema"]}}]


@pytest.mark.parametrize("choice,mode,name", [
    ({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather"),
    ({"type": "none"}, "none", None)])
def test_tool_choice(choice, mode, name):
    chat = to_chat_request(_req(tools=[WEATHER], tool_choice=choice))
    tools = parse_tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    assert (tools.mode, tools.name, tools.parallel) == (mode, name, True)


def test_disable_parallel_tool_use():
    chat = to_chat_request(_req(tools=[WEATHER], tool_choice={
        "type": "any", "disable_parallel_tool_use": True}))
    assert parse_tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls).parallel \
        is False


def test_prefill_continues_the_last_assistant_turn():
    chat = to_chat_request(_req(messages=[{"role": "user", "content": "Pick A or B"},
                                          {"role": "assistant", "content": "The answer is ("}]))
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize("thinking,enabled", [
    ({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False)])
def test_thinking_is_the_enable_thinking_template_variable(thinking, enabled):
    chat = to_chat_request(_req(max_tokens=2048, thinking=thinking))
    assert chat.chat_template_kwargs == {"enable_thinking": enabled}


def test_output_config_format_is_a_strict_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat_request(_req(output_config={"format": {"type": "json_schema",
                                                          "schema": schema}}))
    assert chat.response_format.json_schema == {"name": "output", "schema": schema,
                                                "strict": True}


def test_count_tokens_request_has_no_sampling():
    chat = to_chat_request(CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert chat.max_tokens is None and chat.stop is None


PNG_SOURCE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def test_image_blocks_become_image_url_parts_in_prompt_order():
    images: list = []
    chat = to_chat_request(_req(messages=[
        {"role": "user", "content": [{"type": "image", "source": PNG_SOURCE},
                                     {"type": "text", "text": "and"},
                                     {"type": "image", "source": {"type": "url",
                                                                  "url": "https://a.example/x"}}]}]),
        images)
    parts = chat.messages[0].model_dump(exclude_none=True)["content"]
    assert [p["type"] for p in parts] == ["image_url", "text", "image_url"]
    assert images == [("messages[0].content[0]", "data:image/png;base64,iVBORw0KGgo="),
                      ("messages[0].content[2]", "https://a.example/x")]
    assert parts[0]["image_url"]["url"] == images[0][1]


@pytest.mark.parametrize("kw,param", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "source": PNG_SOURCE},
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[2].source"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        **PNG_SOURCE, "media_type": "image/bmp"}}]}]}, "messages[0].content[0].source.media_type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image",
                                                              "source": PNG_SOURCE}]}]}]},
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image", "source": PNG_SOURCE}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]}, "messages[0].content[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
    ({"max_tokens": 1500, "thinking": {"type": "enabled", "budget_tokens": 1500}},
     "thinking.budget_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_refused_with_the_field_named(kw, param):
    with pytest.raises(APIError) as info:
        to_chat_request(_req(**kw))
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(param.split("[")[0])


def test_strict_tool_is_accepted_when_the_call_is_forced():
    to_chat_request(_req(tools=[{**WEATHER, "strict": True}], tool_choice={"type": "any"}))


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},  # max_tokens required
    {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "messages": []},
    {"model": "m", "max_tokens": 5, "temperature": 1.5,
     "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "container": "c",
     "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
     "messages": [{"role": "user", "content": "hi"}]},
])
def test_schema_refusals(body):
    with pytest.raises(ValueError):
        MessagesRequest.model_validate(body)


def _tools(mode: str, **kw):
    chat = to_chat_request(_req(tools=[WEATHER], tool_choice={"type": mode, **kw}))
    return parse_tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls)


def test_answer_blocks():
    assert answer_blocks("", None) == []
    assert [b.text for b in answer_blocks("hello", None)] == ["hello"]
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    blocks = answer_blocks(text, _tools("auto"))
    assert [b.type for b in blocks] == ["text", "tool_use"]
    assert blocks[0].text == "Sure." and blocks[1].name == "get_weather"
    assert blocks[1].input == {"city": "Oslo"} and blocks[1].id.startswith("toolu_")
    named = answer_blocks('{"city": "Rome"}', _tools("tool", name="get_weather"))
    assert [(b.type, b.input) for b in named] == [("tool_use", {"city": "Rome"})]
    many = json.dumps([{"name": "get_weather", "parameters": {"city": c}} for c in "AB"])
    assert [b.input for b in answer_blocks(many, _tools("any"))] == [{"city": "A"},
                                                                     {"city": "B"}]
    # A forced call cut by max_tokens is no call: the client gets the text.
    assert [b.type for b in answer_blocks('{"city": "Ro', _tools("any"))] == ["text"]


def test_stop_reason():
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)


def test_openapi_schema_is_self_contained():
    schema = json.dumps(inline_schema(MessagesRequest))
    assert "$ref" not in schema and '"max_tokens"' in schema and '"tool_result"' in schema
