"""POST /v1/messages and POST /v1/messages/count_tokens on the chat machinery: the request is
translated (``convert.py``), rendered and tokenized by the chat path, sampled with its
parameters; the output is shaped into Anthropic's blocks (``output.py``) or events
(``streaming.py``). Image blocks are loaded by the chat path's image loader; the prompt's length
counts each image as the tokens it expands to (``count_tokens`` too)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bladellm.entrypoints.anthropic.convert import to_chat_request
from bladellm.entrypoints.anthropic.output import (
    OutputShape, message_blocks, stop_reason, usage)
from bladellm.entrypoints.anthropic.protocol import (
    CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest, _PromptRequest)
from bladellm.entrypoints.anthropic.streaming import message_events
from bladellm.entrypoints.openai.chat_template import template_options
from bladellm.entrypoints.openai.protocol import ChatCompletionRequest
from bladellm.entrypoints.openai.serving_chat import chat_prompt_ids, load_images
from bladellm.entrypoints.openai.structured_output import after_reasoning
from bladellm.entrypoints.openai.serving_common import (
    SSE_HEADERS, ServingContext, UsageCounter, build_sampling_params, check_output,
    context_length_error, merge_streams, naming_context_errors, until_disconnect)
from bladellm.errors import ContextLengthError
from bladellm.http.errors import bad_request
from bladellm.entrypoints.openai.tool_calls import ToolChoice, forced_constraint, parse_tool_choice


@dataclass
class Prepared:
    chat: ChatCompletionRequest  # the same request in chat-completions terms
    tools: ToolChoice | None
    prompt: list[int]  # one placeholder token per image
    prompt_text: str  # as rendered: its end tells whether the template opened the thinking
    lora: Any
    images: list[Any] | None  # the image blocks' images, in prompt order
    num_prompt_tokens: int  # the prompt's length with each image expanded to its tokens


async def prepare(req: _PromptRequest, ctx: ServingContext) -> Prepared:
    """Checks, then the prompt's token ids as the engine will see them (before each image
    placeholder is expanded to the image's tokens) and its length after."""
    lora = await ctx.check_model(req.model)
    image_parts: list[tuple[str, str]] = []
    chat = to_chat_request(req, image_parts)
    tools = parse_tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    template_options(chat, ctx.trust_request_chat_template)  # 400s before any CPU work
    # Before rendering: a text-only model's 400 names the first image block.
    images = await ctx.offload.run(load_images, image_parts, ctx) if image_parts else None
    prompt, text = await ctx.offload.run(chat_prompt_ids, chat, ctx, tools)
    num_prompt = len(prompt)
    if images:
        num_prompt = await ctx.offload.run(_expanded_length, prompt, images, ctx)
    return Prepared(chat, tools, prompt, text, lora, images, num_prompt)


def _expanded_length(prompt: list[int], images: list[Any], ctx: ServingContext) -> int:
    """The prompt's length once each image placeholder stands for the image's tokens (their
    count depends on the model and, for some, on the image's size: the image processor's)."""
    try:
        ids, _ = ctx.engine.input_processor.images.process(prompt, images, param="messages")
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return len(ids)


async def count_tokens(req: CountTokensRequest, raw: Request, ctx: ServingContext) -> Response:
    prepared = await prepare(req, ctx)
    body = CountTokensResponse(input_tokens=prepared.num_prompt_tokens)
    return Response(body.model_dump_json(), media_type="application/json")


async def create_message(req: MessagesRequest, raw: Request, ctx: ServingContext) -> Response:
    p = await prepare(req, ctx)
    max_tokens = _fit_max_tokens(req.max_tokens, p.num_prompt_tokens, ctx.max_model_len)
    params = build_sampling_params(p.chat, ctx, max_tokens=max_tokens, logprobs=None,
                                   forced_constraint=forced_constraint(p.tools))
    parser = ctx.reasoning_parser.for_prompt(p.prompt_text) \
        if ctx.reasoning_parser is not None else None
    # Forced tool calls and output_config.format constrain the answer, not the thinking.
    params.guided_decoding = after_reasoning(params.guided_decoding, parser, ctx.tokenizer)
    shape = OutputShape(p.tools, parser,
                        omit_thinking=getattr(req.thinking, "display", None) == "omitted",
                        context_bound=max_tokens < req.max_tokens)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    merged = merge_streams([ctx.generate(p.prompt, params, message_id, p.lora,
                                         images=p.images)])
    model = p.lora.lora_name if p.lora is not None else ctx.model_name
    if req.stream:
        first = await naming_context_errors(until_disconnect(anext(merged), raw), "messages")
        body = message_events(message_id, model, first, merged, shape)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    message = await naming_context_errors(
        until_disconnect(_collect(message_id, model, merged, shape), raw), "messages")
    return Response(message.model_dump_json(), media_type="application/json")


def _fit_max_tokens(max_tokens: int, num_prompt: int, max_model_len: int) -> int:
    """``max_tokens`` lowered to the room the context leaves, as Anthropic's API does (the
    output then ends with ``model_context_window_exceeded``; clients such as Claude Code send
    a large ``max_tokens`` whatever the model). A prompt that leaves no room is a 400."""
    room = max_model_len - num_prompt
    if room < 1:
        raise context_length_error(ContextLengthError(
            "", num_prompt_tokens=num_prompt, max_tokens=None, max_model_len=max_model_len),
            "messages")
    return min(max_tokens, room)


async def _collect(message_id: str, model: str, merged: Any,
                   shape: OutputShape) -> MessageResponse:
    counter = UsageCounter()
    texts: list[str] = []
    finish, stop = None, None
    async for _, out in merged:
        check_output(out)
        counter.add(0, out)
        comp = out.outputs[0]
        texts.append(comp.text)
        if comp.finish_reason is not None:
            finish, stop = comp.finish_reason, comp.stop_reason
    blocks = message_blocks("".join(texts), shape)
    reason, sequence = stop_reason(finish, stop, any(b.type == "tool_use" for b in blocks),
                                   shape.context_bound)
    return MessageResponse(id=message_id, model=model, content=blocks, stop_reason=reason,
                           stop_sequence=sequence, usage=usage(counter))
