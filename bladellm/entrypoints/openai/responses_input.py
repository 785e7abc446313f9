"""A Responses request as the chat machinery's request: input items → chat messages, function
tools → chat tools, ``text.format`` → ``response_format``, ``max_output_tokens`` →
``max_completion_tokens``. Everything after that (template, tool parsing, structured output,
sampling) is the chat path's own code.

Item → message rules: ``developer`` stays a system prompt (as on chat); ``function_call`` items
join the assistant message before them (or start one) as its ``tool_calls``;
``function_call_output`` becomes a ``tool`` message; a ``reasoning`` item is the next assistant
message's ``reasoning_content`` (templates that render earlier thinking use it, others drop it).
An ``input_image`` part of a user, system or developer message becomes the chat's ``image_url``
part, and its ``(param, url)`` joins the request's image list, which the chat path's image
loader (``serving_chat.load_images``) turns into the engine's images; stored turns keep their
image parts, so a ``previous_response_id`` follow-up renders the same prompt with the same
images.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import TypeAdapter

from bladellm.entrypoints.openai.protocol import ChatCompletionRequest
from bladellm.entrypoints.openai.protocol_responses import (
    ContentPart, FunctionCallItem, FunctionCallOutputItem, InputItem, ItemReference, MessageItem,
    ReasoningItem, ResponsesRequest)
from bladellm.http.errors import APIError, bad_request, unsupported

_ITEMS = TypeAdapter(list[InputItem])
_TEXT_PARTS = ("input_text", "output_text", "text")
_DETAILS = ("auto", "low", "high", "original")  # OpenAI's ImageDetail
LOGPROBS = "message.output_text.logprobs"
# What `include` may ask for. Reasoning items always carry their text in the clear (`content`),
# so a client that asks for the encrypted copy to replay reasoning statelessly gets what it needs
# by sending the items back; the field itself stays null.
_INCLUDABLE = ("reasoning.encrypted_content", LOGPROBS)
MAX_TOP_LOGPROBS = 20


def check_request(req: ResponsesRequest) -> None:
    """400 for what this server declares but cannot do."""
    if req.background:
        raise bad_request("background: background mode is not supported by this server; send "
                          "the request without it (stream: true to follow progress)",
                          "background", code="unsupported_parameter")
    for name in ("max_tool_calls", "conversation", "prompt"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got "
                          f"{req.top_logprobs}", "top_logprobs")
    if req.truncation == "auto":
        raise unsupported("truncation", "truncation 'auto' (dropping input items that do not "
                                        "fit)")
    for value in req.include or []:
        if value not in _INCLUDABLE:
            raise unsupported("include", f"include {value!r}")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "text.verbosity other than 'medium'")
    _check_metadata(req.metadata)
    if isinstance(req.input, str) and not req.input:
        raise bad_request("input: must not be empty", "input")
    if isinstance(req.input, list) and not req.input and req.previous_response_id is None:
        raise bad_request("input: must contain at least one item", "input")


def logprobs(req: ResponsesRequest, may_think: bool, has_tools: bool) -> int | None:
    """How many alternatives per token the answer's logprobs carry (None: no logprobs). They
    are given where every generated token is answer text: not with tools (their calls are cut
    out of the text), nor while the model may think (``--reasoning_parser`` takes the thinking
    out; a template that closed the thinking in the prompt leaves all of it answer)."""
    if LOGPROBS not in (req.include or []) and req.top_logprobs is None:
        return None
    param = "top_logprobs" if req.top_logprobs is not None else "include"
    if has_tools:
        raise unsupported(param, "logprobs together with tools")
    if may_think:
        raise unsupported(param, "logprobs for a reasoning model's output that may hold "
                                 "thinking (--reasoning_parser)")
    return req.top_logprobs or 0


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if not metadata:
        return
    if len(metadata) > 16:
        raise bad_request(f"metadata: at most 16 key-value pairs, got {len(metadata)}",
                          "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(f"metadata: keys are at most 64 characters and values at most "
                              f"512 (key {key[:64]!r})", "metadata")


# --------------------------------------------------------------------------------- tools


def chat_tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) in the chat API's shapes; 400 naming a hosted tool."""
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type: '{tool.type}' is a hosted tool that this "
                              f"server cannot run; only 'function' tools are supported",
                              f"tools[{i}].type", code="unsupported_tool")
        if not tool.name:
            raise bad_request(f"tools[{i}].name: a function tool needs a name",
                              f"tools[{i}].name", code="missing_required_parameter")
        fn = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
        if tool.description is not None:
            fn["description"] = tool.description
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind == "allowed_tools":
            tools, choice = _allowed(tools, choice)
        else:
            raise bad_request(f"tool_choice.type: {kind!r} is not supported by this server "
                              f"(only 'function' and 'allowed_tools')", "tool_choice.type",
                              code="unsupported_tool")
    return tools or None, choice


def _allowed(tools: list[dict[str, Any]], choice: dict[str, Any]):
    mode = choice.get("mode", "auto")
    allowed = choice.get("tools")
    if mode not in ("auto", "required") or not isinstance(allowed, list):
        raise bad_request("tool_choice: allowed_tools needs mode 'auto' or 'required' and a "
                          "list of tools", "tool_choice")
    names = {t.get("name") for t in allowed if isinstance(t, dict)}
    kept = [t for t in tools if t["function"]["name"] in names]
    missing = names - {t["function"]["name"] for t in kept}
    if missing:
        raise bad_request(f"tool_choice.tools: {sorted(map(str, missing))} not among the "
                          f"request's tools", "tool_choice")
    return kept, mode


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema: required for type 'json_schema'",
                          "text.format.schema", code="missing_required_parameter")
    spec: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": spec}


# --------------------------------------------------------------------------------- items


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as item dicts (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        if isinstance(item, ItemReference):
            raise unsupported(f"input[{i}]", "item_reference input items")
        if isinstance(item, MessageItem) and isinstance(item.content, list):
            _parts(item.content, f"input[{i}].content",
                   None if item.role == "assistant" else [])
        if isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list):
            _parts(item.output, f"input[{i}].output", None)
    return [item.model_dump(mode="json", exclude_none=True) for item in req.input]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as a stored response lists them (``GET .../input_items``): each with an ``id``, a
    message's string content as one text part (rendered the same)."""
    result = []
    for item in items:
        kind = item.get("type", "message")
        item = {"type": kind, **item}
        item.setdefault("id", f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}")
        if kind == "message":
            item.setdefault("status", "completed")
            if isinstance(item["content"], str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        result.append(item)
    return result


ImagePart = tuple[str, str]  # (the request field naming an image part, its URL)


def _parts(parts: list[ContentPart], param: str,
           images: list[ImagePart] | None) -> list[dict[str, Any]]:
    """Content parts as chat parts; each ``input_image`` is appended to ``images`` (None: this
    place cannot hold images, a 400)."""
    result: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.type == "input_image":
            url = _image_url(part, f"{param}[{j}]", images is not None)
            images.append((f"{param}[{j}]", url))  # type: ignore[union-attr]
            result.append({"type": "image_url", "image_url": {"url": url}})
        elif part.type in _TEXT_PARTS:
            if part.text is None:
                raise bad_request(f"{param}[{j}].text: required for a '{part.type}' part",
                                  f"{param}[{j}].text", code="missing_required_parameter")
            result.append({"type": "text", "text": part.text})
        elif part.type == "refusal":
            result.append({"type": "text", "text": part.refusal or ""})
        else:
            raise bad_request(f"{param}[{j}].type: '{part.type}' content is not supported by "
                              f"this server (text and input_image only)", f"{param}[{j}].type",
                              code="unsupported_content")
    return result


def _image_url(part: ContentPart, param: str, allowed: bool) -> str:
    """An ``input_image`` part's URL; 400 naming the part for what the server cannot take.
    ``detail`` is accepted and changes nothing: the model's own image processor fixes the
    resolution an image is seen at."""
    if not allowed:
        raise bad_request(f"{param}: an input_image cannot appear here (only in user, system "
                          f"or developer messages)", param, code="unsupported_content")
    if part.file_id is not None:
        raise bad_request(f"{param}.file_id: file inputs are not supported by this server "
                          f"(it has no Files API); send the image as image_url, a data: URL",
                          f"{param}.file_id", code="unsupported_parameter")
    if not part.image_url:
        raise bad_request(f"{param}.image_url: an input_image needs an image_url (a data: URL "
                          f"or an http(s) URL)", f"{param}.image_url",
                          code="missing_required_parameter")
    if part.detail is not None and part.detail not in _DETAILS:
        raise bad_request(f"{param}.detail: must be one of {list(_DETAILS)}, got "
                          f"{part.detail!r}", f"{param}.detail")
    return part.image_url


def _reasoning_text(item: ReasoningItem) -> str:
    parts = item.content if item.content else item.summary
    return "".join(p.text for p in parts)


def to_messages(items: list[dict[str, Any]], images: list[ImagePart] | None = None,
                first_input: int = 0) -> list[dict[str, Any]]:
    """Item dicts (stored turns, then this input from ``items[first_input]`` on) as chat
    messages; their image parts, in prompt order, are appended to ``images``."""
    messages: list[dict[str, Any]] = []
    images = [] if images is None else images

    def param(i: int) -> str:  # a stored turn's item: the i-th of the stored conversation
        return f"input[{i - first_input}]" if i >= first_input \
            else f"previous_response_id.items[{i}]"

    reasoning: str | None = None

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = reasoning
        reasoning = None
        messages.append(msg)
        return msg

    for i, item in enumerate(_ITEMS.validate_python(items)):
        if isinstance(item, MessageItem):
            content: Any = item.content
            if isinstance(content, list):
                content = _parts(content, f"{param(i)}.content",
                                 None if item.role == "assistant" else images)
            if item.role == "assistant":
                assistant()["content"] = content
            else:
                messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            msg = last if last is not None and last["role"] == "assistant" and not reasoning \
                else assistant()
            msg.setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            output: Any = item.output
            if isinstance(output, list):
                output = "".join(p["text"] for p in _parts(output, f"{param(i)}.output",
                                                           None))
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + _reasoning_text(item)
    return messages


def chat_request(req: ResponsesRequest, items: list[dict[str, Any]],
                 images: list[ImagePart] | None = None,
                 first_input: int = 0) -> ChatCompletionRequest:
    """The chat request that renders and samples this Responses request (``to_messages``)."""
    messages = to_messages(items, images, first_input)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise bad_request("input: the conversation is empty", "input")
    tools, tool_choice = chat_tools(req)
    kwargs: dict[str, Any] = {}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        # A template variable, as vLLM passes it (gpt-oss-style templates read it); "none" also
        # turns thinking off in Qwen3-style templates.
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    try:
        return ChatCompletionRequest(
            model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, user=req.user, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls,
            response_format=response_format(req), stream=req.stream,
            chat_template_kwargs=kwargs or None)
    except APIError:
        raise
    except ValueError as exc:  # pydantic: a message the chat model refuses
        raise bad_request(f"input: {exc}", "input") from None
