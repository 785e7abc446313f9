"""An Anthropic Messages request as the chat-completions request the chat machinery serves.

Anthropic's shapes map onto OpenAI chat's one to one where it matters to the prompt: ``system``
becomes the system message; a user turn's ``tool_result`` blocks become ``tool`` messages (in
their place among the turn's text); an assistant turn's ``tool_use`` blocks become its
``tool_calls``; ``tools`` become function tools (``input_schema`` as ``parameters``);
``tool_choice`` auto / any / tool / none become auto / required / named / none; ``thinking``
becomes the template variable ``enable_thinking``. A conversation that ends with an assistant
turn is continued (Anthropic's prefill), not answered. A user turn's ``image`` blocks become
the chat's ``image_url`` parts (a base64 source as a data: URL of its ``media_type``, which the
image loader checks against the bytes; a url source as it is, fetched only from
``--allowed_media_domains``), and each one's ``(block, url)`` joins the request's image list,
which the chat path's loader (``serving_chat.load_images``) turns into the engine's images.
"""

from __future__ import annotations

from typing import Any

from bladellm.entrypoints.anthropic.protocol import (
    Base64ImageSource, FileImageSource, ImageBlock, InputMessage, MessagesRequest,
    RedactedThinkingBlock, TextBlock, ThinkingBlock, ThinkingDisabled, ToolChoiceAny,
    ToolChoiceAuto, ToolChoiceNone, ToolChoiceTool, ToolResultBlock, ToolUseBlock, _PromptRequest)
from bladellm.entrypoints.openai.protocol import ChatCompletionRequest
from bladellm.http.errors import bad_request

TOOL_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reaches the model
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's
ImagePart = tuple[str, str]  # (the block, as messages[i].content[j]; its URL)


def to_chat_request(req: _PromptRequest,
                    images: list[ImagePart] | None = None) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples with the same parameters;
    the request's image blocks, in prompt order, are appended to ``images``."""
    _check_tools(req)
    images = [] if images is None else images
    messages = _system(req) + [m for i, msg in enumerate(req.messages)
                               for m in _turn(i, msg, images)]
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.messages[-1].role == "assistant":  # prefill: the answer continues this turn
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {
            "enable_thinking": not isinstance(req.thinking, ThinkingDisabled)}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req)
        if getattr(req.tool_choice, "disable_parallel_tool_use", None):
            fields["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_, "strict": True}}
    if isinstance(req, MessagesRequest):
        _check_sampling(req)
        fields.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, stop=req.stop_sequences or None)
    return ChatCompletionRequest(**fields)


# ---------------------------------------------------------------------------------- checks


def _check_tools(req: _PromptRequest) -> None:
    names = [t.name for t in req.tools or ()]
    choice = req.tool_choice
    forced = isinstance(choice, (ToolChoiceAny, ToolChoiceTool))
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise bad_request(f"tool_choice.name: {choice.name!r} is not among the tools {names}",
                          "tool_choice.name")
    if forced and not names:
        raise bad_request(f"tool_choice: {choice.type!r} requires tools",  # type: ignore[union-attr]
                          "tool_choice")
    for i, tool in enumerate(req.tools or ()):
        if tool.strict and not forced:
            # Only a forced call is generated under the schema; a call the model writes on
            # its own (tool_choice auto) is parsed from free text.
            raise bad_request(f"tools[{i}].strict: schema-exact tool input is guaranteed only "
                              f"with tool_choice 'any' or 'tool' on this server",
                              f"tools[{i}].strict")
    if forced and req.output_config is not None and req.output_config.format is not None:
        raise bad_request("output_config.format: cannot be combined with a forced tool "
                          "(tool_choice 'any' or 'tool')", "output_config.format")


def _check_sampling(req: MessagesRequest) -> None:
    thinking = req.thinking
    if getattr(thinking, "budget_tokens", None) is not None \
            and thinking.budget_tokens >= req.max_tokens:  # type: ignore[union-attr]
        raise bad_request(f"thinking.budget_tokens: must be less than max_tokens "
                          f"({thinking.budget_tokens} >= {req.max_tokens})",  # type: ignore[union-attr]
                          "thinking.budget_tokens")
    for i, stop in enumerate(req.stop_sequences or ()):
        if not stop:
            raise bad_request(f"stop_sequences[{i}]: must not be empty", "stop_sequences")


def _tool_choice(req: _PromptRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if isinstance(choice, ToolChoiceNone):
        return "none"
    assert isinstance(choice, ToolChoiceAuto)
    return "auto" if req.tools else None


# -------------------------------------------------------------------------------- messages


def _system(req: _PromptRequest) -> list[dict[str, Any]]:
    if req.system is None:
        return []
    if isinstance(req.system, str):
        return [{"role": "system", "content": req.system}] if req.system else []
    parts = [{"type": "text", "text": b.text} for b in req.system]
    return [{"role": "system", "content": parts}] if parts else []


def _turn(i: int, msg: InputMessage, images: list[ImagePart]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages (a user turn with tool results becomes several)."""
    blocks = [TextBlock(type="text", text=msg.content)] if isinstance(msg.content, str) \
        else msg.content
    if msg.role == "assistant":
        return [_assistant(i, blocks)]
    result: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            url = _image_url(where, block)
            images.append((where, url))
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(block, ToolResultBlock):
            if parts:  # keep the turn's order: text before the result stays before it
                result.append({"role": "user", "content": parts})
                parts = []
            result.append({"role": "tool", "tool_call_id": block.tool_use_id,
                           "content": _tool_result_text(where, block)})
        else:
            _refuse(where, block, "user")
    if parts or not result:
        result.append({"role": "user", "content": parts or ""})
    return result


def _assistant(i: int, blocks: list[Any]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            continue  # earlier turns' thinking is not part of the context (as on Anthropic's)
        else:
            _refuse(f"messages[{i}].content[{j}]", block, "assistant")
    entry: dict[str, Any] = {"role": "assistant", "content": parts or ""}
    if calls:
        entry["tool_calls"] = calls
    return entry


def _tool_result_text(where: str, block: ToolResultBlock) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, ImageBlock):
                raise bad_request(f"{where}.content[{k}]: images inside a tool_result are not "
                                  f"supported by this server; send the image as an image "
                                  f"block of the user turn", f"{where}.content[{k}]",
                                  code="unsupported_content")
            texts.append(part.text)
        text = "\n".join(texts)
    return TOOL_ERROR_PREFIX + text if block.is_error else text


def _refuse(where: str, block: Any, role: str) -> None:
    raise bad_request(f"{where}: a {block.type} block cannot appear in a {role} message", where)


def _image_url(where: str, block: ImageBlock) -> str:
    """An image block's URL for the image loader; 400 naming the block for a source or option
    the server cannot take (the loader names it for the image itself)."""
    if block.transformations:
        raise bad_request(f"{where}.transformations: image transformations are not supported "
                          f"by this server", f"{where}.transformations",
                          code="unsupported_content")
    source = block.source
    if isinstance(source, FileImageSource):
        raise bad_request(f"{where}.source: file sources are not supported by this server (it "
                          f"has no Files API); send a base64 or url source", f"{where}.source",
                          code="unsupported_content")
    if isinstance(source, Base64ImageSource):
        if source.media_type not in MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type: must be one of {list(MEDIA_TYPES)}, "
                              f"got {source.media_type!r}", f"{where}.source.media_type")
        return f"data:{source.media_type};base64,{source.data}"
    return source.url
