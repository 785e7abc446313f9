"""POST /v1/chat/completions: chat template, multi-turn, n, logprobs/top_logprobs, stream."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bladellm.engine.prompt_limits import check_prompt_chars
from bladellm.entrypoints.openai.chat_template import template_options
from bladellm.entrypoints.openai.errors import bad_request, from_exception, unsupported
from bladellm.entrypoints.openai.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, DeltaMessage)
from bladellm.entrypoints.openai.serving_common import (
    SSE_DONE, SSE_HEADERS, ServingContext, UsageCounter, build_sampling_params, chat_logprobs,
    check_output, merge_streams, reject_unsupported, sse, stream_usage_flags, until_disconnect)
from bladellm.outputs import RequestOutput

_MAX_TOP_LOGPROBS = 20


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it


def _check(req: ChatCompletionRequest) -> None:
    reject_unsupported(req)
    if req.prompt_logprobs is not None:  # served on /v1/completions only
        raise unsupported("prompt_logprobs", "prompt_logprobs on chat completions")
    if req.tools:
        raise unsupported("tools", "tool calling")
    if req.tool_choice not in (None, "none"):
        raise unsupported("tool_choice", "tool calling")
    for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort",
                 "web_search_options"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "output modalities other than text")
    if not req.messages:
        raise bad_request("messages: must contain at least one message", "messages")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs: must be in [0, {_MAX_TOP_LOGPROBS}], "
                              f"got {req.top_logprobs}", "top_logprobs")


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content is plain text."""
    result = []
    for i, msg in enumerate(req.messages):
        if msg.tool_calls:
            raise unsupported(f"messages[{i}].tool_calls", "tool calling")
        content = msg.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise unsupported(f"messages[{i}].content",
                                      f"content part of type '{part.type}'")
                texts.append(part.text)
            content = "\n".join(texts)
        # OpenAI's "developer" role is the system prompt of newer models; templates know "system".
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        result.append(entry)
    return result


def _prompt_ids(req: ChatCompletionRequest, ctx: ServingContext) -> list[int]:
    """Render and tokenize; CPU-heavy for long conversations, so it runs in ``ctx.offload``."""
    options = template_options(req, ctx.trust_request_chat_template)
    kwargs = dict(options.kwargs)
    if "chat_template" not in kwargs and ctx.default_chat_template is not None:
        kwargs["chat_template"] = ctx.default_chat_template
    if options.continue_final_message:
        kwargs["continue_final_message"] = True
    text = ctx.engine.input_processor.apply_chat_template(
        _messages(req), add_generation_prompt=options.add_generation_prompt, **kwargs)
    check_prompt_chars(text, ctx.max_prompt_chars, ctx.max_model_len, "messages")
    # The template already wrote the special tokens (BOS, role markers): add none.
    return list(ctx.tokenizer.encode(text, add_special_tokens=False))


async def create_chat_completion(req: ChatCompletionRequest, raw: Request,
                                 ctx: ServingContext) -> Response:
    ctx.check_model(req.model)
    _check(req)
    template_options(req, ctx.trust_request_chat_template)  # 400s before any CPU work
    prompt = await ctx.offload.run(_prompt_ids, req, ctx)  # ValueError (bad messages) -> 400
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, ctx, max_tokens=max_tokens, logprobs=logprobs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    merged = merge_streams([ctx.engine.generate(prompt, params, request_id)])
    choices = [_Choice() for _ in range(req.n)]
    if req.stream:
        first = await until_disconnect(anext(merged), raw)
        body = _stream(req, request_id, ctx.model_name, first, merged, choices)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await until_disconnect(_collect(req, merged, choices), raw)
    response = ChatCompletionResponse(
        id=request_id, model=ctx.model_name, usage=usage,
        choices=[ChatChoice(index=k, message=ChatResponseMessage(content="".join(c.texts)),
                            logprobs=c.logprobs, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason)
                 for k, c in enumerate(choices)])
    return Response(response.model_dump_json(), media_type="application/json")


def _apply(req: ChatCompletionRequest, out: RequestOutput, choices: list[_Choice]):
    """Fold one engine output into the choices; return (index, new text, logprobs, finish)."""
    check_output(out)
    updates = []
    for comp in out.outputs:
        choice = choices[comp.index]
        choice.texts.append(comp.text)
        new_lp = chat_logprobs(comp.logprobs) if req.logprobs and comp.logprobs else None
        if new_lp is not None:
            if choice.logprobs is None:
                choice.logprobs = ChatLogprobs(content=[])
            choice.logprobs.content.extend(new_lp.content or [])  # type: ignore[union-attr]
        if comp.finish_reason is not None:
            choice.finish_reason = comp.finish_reason
            choice.stop_reason = comp.stop_reason
        updates.append((comp.index, comp.text, new_lp, comp.finish_reason))
    return updates


async def _collect(req: ChatCompletionRequest, merged: AsyncIterator, choices: list[_Choice]):
    usage = UsageCounter()
    async for i, out in merged:
        usage.add(i, out)
        _apply(req, out, choices)
    if req.logprobs:
        for c in choices:
            c.logprobs = c.logprobs or ChatLogprobs(content=[])
    return usage.usage()


async def _stream(req: ChatCompletionRequest, request_id: str, model: str, first, merged,
                  choices: list[_Choice]) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous, exclude = stream_usage_flags(req.stream_options)
    usage = UsageCounter()

    def chunk(k: int, delta: DeltaMessage, lp=None, finish=None) -> str:
        c = ChatCompletionChunk(
            id=request_id, created=created, model=model,
            choices=[ChatChunkChoice(index=k, delta=delta, logprobs=lp, finish_reason=finish,
                                     stop_reason=choices[k].stop_reason if finish else None)],
            usage=usage.usage() if continuous else None)
        return sse(c.model_dump_json(exclude=exclude))

    try:
        for k in range(len(choices)):
            yield chunk(k, DeltaMessage(role="assistant", content=""))
        item = first
        while True:
            _, out = item
            usage.add(0, out)
            for k, text, lp, finish in _apply(req, out, choices):
                if text or lp is not None or finish is not None:
                    yield chunk(k, DeltaMessage(content=text or None), lp, finish)
            try:
                item = await anext(merged)
            except StopAsyncIteration:
                break
        if include_usage:
            final = ChatCompletionChunk(id=request_id, created=created, model=model,
                                        choices=[], usage=usage.usage())
            yield sse(final.model_dump_json())
    except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band
        yield sse(json.dumps(from_exception(exc).body()))
    finally:
        await merged.aclose()
    yield SSE_DONE
