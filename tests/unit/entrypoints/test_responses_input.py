"""Responses input items → the chat messages the chat template renders."""

import pytest

from bladellm.entrypoints.openai.protocol_responses import ResponsesRequest
from bladellm.entrypoints.openai.responses_input import chat_request, input_items, to_messages
from bladellm.http.errors import APIError


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
    ]
    messages = to_messages(items)
    assert messages == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"}],
         "reasoning_content": "think",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function",
              "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]  # a trailing reasoning item with no assistant turn after it is dropped


def test_chat_request_maps_the_fields():
    req = ResponsesRequest.model_validate({
        "input": "hi", "instructions": "sys", "max_output_tokens": 7, "temperature": 0.2,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "reasoning": {"effort": "none"}})
    chat = chat_request(req, input_items(req))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.2
    assert chat.tools == [{"type": "function",
                           "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}


def test_allowed_tools_narrow_the_tools():
    req = ResponsesRequest.model_validate({
        "input": "hi", "tools": [{"type": "function", "name": n} for n in "fgh"],
        "tool_choice": {"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": "g"}]}})
    chat = chat_request(req, input_items(req))
    assert [t["function"]["name"] for t in chat.tools] == ["g"]
    assert chat.tool_choice == "required"


def test_item_reference_is_refused():
    req = ResponsesRequest.model_validate({"input": [{"type": "item_reference", "id": "x"}]})
    with pytest.raises(APIError) as err:
        input_items(req)
    assert err.value.param == "input[0]"


def test_reasoning_item_reaches_the_chat_message():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"}]})
    chat = chat_request(req, input_items(req))
    assert chat.messages[1].role == "assistant" and chat.messages[1].reasoning_content == "think"


def test_input_images_become_image_url_parts_named_by_their_item():
    stored = [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"}]},
        {"type": "message", "role": "assistant", "content": "ok"}]
    req = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "and"},
        {"type": "input_image", "image_url": "https://a.example/b.png", "detail": "high"}]}]})
    images: list = []
    chat = chat_request(req, stored + input_items(req), images, first_input=len(stored))
    assert images == [("previous_response_id.items[0].content[0]", "data:image/png;base64,AA"),
                      ("input[0].content[1]", "https://a.example/b.png")]
    last = chat.messages[-1].model_dump(exclude_none=True)["content"]
    assert last == [{"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": "https://a.example/b.png"}}]
    # Stored as sent: the image part survives into the stored items.
    assert input_items(req)[0]["content"][1]["image_url"] == "https://a.example/b.png"


@pytest.mark.parametrize("part,param", [
    ({"type": "input_image", "file_id": "file-1", "detail": "auto"}, "input[0].content[0].file_id"),
    ({"type": "input_image", "detail": "auto"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": "data:,", "detail": "huge"},
     "input[0].content[0].detail"),
])
def test_bad_input_image_is_400_naming_the_part(part, param):
    req = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [part]}]})
    with pytest.raises(APIError) as info:
        input_items(req)
    assert info.value.status == 400 and info.value.param == param
