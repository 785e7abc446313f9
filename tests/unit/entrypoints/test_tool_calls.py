"""Tool-call parsing (Hermes / Qwen2.5 and Llama 3.x JSON), streaming hold-back, and the
constraints that force a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bladellm.http.errors import APIError
from bladellm.entrypoints.openai.tool_calls import (AutoToolStream, forced_calls,
                                                    forced_constraint, parse_auto,
                                                    parse_tool_choice)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop"}}]
NAMES = ["get_weather", "noop"]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me look. <tool_call>{"name": "noop", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
     "Let me look.", [("noop", {}), ("get_weather", {"city": "Rome"})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "noop", "parameters": {}}; {"name": "noop", "parameters": {}}',
     None, [("noop", {}), ("noop", {})]),
    ('{"name": "unknown_tool", "parameters": {}}', '{"name": "unknown_tool", "parameters": {}}',
     []),
    ('<tool_call>{not json}</tool_call>', '<tool_call>{not json}</tool_call>', []),
    ("just text", "just text", []),
])
def test_parse_auto(text, content, calls):
    got_content, got_calls = parse_auto(text, NAMES)
    assert got_content == content and _calls(got_calls) == calls


@pytest.mark.parametrize("text,streamed,calls", [
    ('Hi <tool_call>{"name": "noop", "arguments": {}}</tool_call>', "Hi ", [("noop", {})]),
    ('{"name": "noop", "parameters": {}}', "", [("noop", {})]),
    ("plain <tool text {}", "plain <tool text {}", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_auto_stream_holds_back_calls(text, streamed, calls):
    stream = AutoToolStream(NAMES)
    out = "".join(stream.feed(ch) for ch in text)
    rest, found = stream.finish()
    assert out + rest == streamed and _calls(found) == calls


def test_forced_constraints_follow_the_function_schemas():
    named = parse_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    field, constraint = forced_constraint(named)
    assert field == "tool_choice" and constraint == {"json": TOOLS[0]["function"]["parameters"]}
    assert _calls(forced_calls(named, '{"city": "Lima"}')) == [("get_weather", {"city": "Lima"})]
    required = parse_tool_choice(TOOLS, "required")
    schema = forced_constraint(required)[1]["json"]
    jsonschema.validate([{"name": "noop", "parameters": {}},
                         {"name": "get_weather", "parameters": {"city": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    assert _calls(forced_calls(required, '[{"name": "noop", "parameters": {}}]')) == [
        ("noop", {})]
    assert forced_calls(required, '[{"name": "no') == []  # cut by max_tokens
    single = forced_constraint(parse_tool_choice(TOOLS, "required", False))[1]["json"]
    assert single["maxItems"] == 1
    assert forced_constraint(parse_tool_choice(TOOLS, "auto")) is None
    assert parse_tool_choice(None, None) is None
    with pytest.raises(APIError, match="requires tools"):
        parse_tool_choice(None, "required")
