"""POST /v1/chat/completions: chat template, multi-turn, n, logprobs/top_logprobs, stream."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bladellm.engine.input_processor import MessageError
from bladellm.entrypoints.openai.chat_template import template_options
from bladellm.http.errors import bad_request, unsupported
from bladellm.http.handlers import from_exception
from bladellm.entrypoints.openai.protocol import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, CompletionTokensDetails,
    DeltaMessage, ToolCall, UsageInfo)
from bladellm.entrypoints.openai.reasoning import ReasoningStream
from bladellm.entrypoints.openai.structured_output import after_reasoning
from bladellm.entrypoints.openai.tool_calls import (
    AutoToolStream, ToolChoice, forced_calls, forced_constraint, new_call, parse_auto,
    parse_tool_choice)
from bladellm.entrypoints.openai.serving_common import (
    SSE_DONE, SSE_HEADERS, ServingContext, UsageCounter, build_sampling_params, chat_logprobs,
    check_output, merge_streams, naming_context_errors, reject_unsupported, sse,
    stream_usage_flags, until_disconnect)
from bladellm.outputs import RequestOutput

_MAX_TOP_LOGPROBS = 20


@dataclass
class ChoiceState:
    texts: list[str] = field(default_factory=list)  # the answer (the thinking split off)
    reasonings: list[str] = field(default_factory=list)  # the thinking (--reasoning_parser)
    reasoning: ReasoningStream | None = None  # splits each delta (--reasoning_parser)
    reasoning_tokens: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    tool_stream: AutoToolStream | None = None  # tool_choice "auto", streaming
    call_id: str | None = None  # named tool_choice, streaming: the call being streamed
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it

    def split(self, text: str, num_tokens: int, final: bool) -> tuple[str, str]:
        """(thinking, answer) of one engine delta; a token counts as thinking when it arrives
        inside the thinking or opens it."""
        stream = self.reasoning
        if stream is None:
            return "", text
        before = stream.in_reasoning
        reasoning, answer = stream.feed(text)
        if before or stream.in_reasoning:
            self.reasoning_tokens += num_tokens
        if final:
            r_tail, a_tail = stream.finish()
            reasoning, answer = reasoning + r_tail, answer + a_tail
        return reasoning, answer


def _check(req: ChatCompletionRequest) -> None:
    reject_unsupported(req)
    if req.prompt_logprobs is not None:  # served on /v1/completions only
        raise unsupported("prompt_logprobs", "prompt_logprobs on chat completions")
    for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort",
                 "web_search_options"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    for i, msg in enumerate(req.messages):
        if msg.role == "function":  # goes with functions / function_call, refused above
            raise bad_request(f"messages[{i}].role: the deprecated 'function' role (legacy "
                              f"function calling) is not supported by this server; send tool "
                              f"results as role 'tool' with a tool_call_id",
                              f"messages[{i}].role", code="unsupported_parameter")
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


def _template_tool_calls(i: int, calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as chat templates expect them: arguments as an object."""
    result = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{j}]: must be {{'type': 'function', "
                              f"'function': {{'name', 'arguments'}}}}", "messages")
        args = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
                why = "nested too deeply" if isinstance(exc, RecursionError) else "not valid JSON"
                raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments: {why}",
                                  "messages") from None
        result.append({**call, "type": "function",
                       "function": {"name": fn["name"], "arguments": args}})
    return result


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as plain dicts for ``InputProcessor.apply_chat_template`` (which
    checks their content and turns text parts into text)."""
    result = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        # OpenAI's "developer" role is the system prompt of newer models; templates know "system".
        role = "system" if msg.role == "developer" else msg.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls:
            entry["tool_calls"] = _template_tool_calls(i, msg.tool_calls)
        thinking = _input_reasoning(i, msg)
        if thinking is not None:
            # The name Qwen3's and DeepSeek-R1's templates read.
            entry["reasoning_content"] = thinking
        result.append(entry)
    return result


def _input_reasoning(i: int, msg: Any) -> str | None:
    """An earlier assistant turn's thinking, sent back as ``reasoning_content`` or
    ``reasoning`` (the names this server answers with)."""
    given = {name: getattr(msg, name) for name in ("reasoning_content", "reasoning")
             if getattr(msg, name) is not None}
    if not given:
        return None
    if msg.role != "assistant":
        name = next(iter(given))
        raise bad_request(f"messages[{i}].{name}: only assistant messages carry reasoning",
                          f"messages[{i}].{name}")
    if len(set(given.values())) > 1:
        raise bad_request(f"messages[{i}]: reasoning_content and reasoning differ; send one",
                          f"messages[{i}].reasoning")
    return next(iter(given.values()))


def chat_prompt_ids(req: ChatCompletionRequest, ctx: ServingContext,
                tools: ToolChoice | None = None) -> tuple[list[int], str]:
    """Render and tokenize; CPU-heavy for long conversations, so it runs in ``ctx.offload``.
    Returns the token ids and the rendered text (whose end tells whether the template opened
    or closed a think block)."""
    options = template_options(req, ctx.trust_request_chat_template)
    kwargs = dict(options.kwargs)
    if tools is not None:
        kwargs["tools"] = tools.tools  # transformers' `tools` argument of the chat template
    if "chat_template" not in kwargs and ctx.default_chat_template is not None:
        kwargs["chat_template"] = ctx.default_chat_template
    if options.continue_final_message:
        kwargs["continue_final_message"] = True
    processor = ctx.engine.input_processor
    try:
        text = processor.apply_chat_template(
            _messages(req), add_generation_prompt=options.add_generation_prompt, **kwargs)
    except MessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None
    # The template already wrote the special tokens (BOS, role markers): add none.
    return processor.tokenize(text, add_special_tokens=False, param="messages"), text


def chat_images(req: ChatCompletionRequest, ctx: ServingContext) -> list[Any]:
    """The images of the request's ``image_url`` parts (decoded, maybe fetched: blocking, so
    it runs in ``ctx.offload``); a bad one is a 400 naming ``messages[i].content[j]``."""
    try:
        return ctx.engine.input_processor.load_chat_images(_messages(req))
    except MessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None


def load_images(parts: list[tuple[str, Any]], ctx: ServingContext) -> list[Any]:
    """The engine's images for a request's image parts, given as ``(param, url)`` in prompt
    order by any API (Responses' ``input_image``, Anthropic's ``image`` blocks as data: URLs):
    the same loader, limits and URL rule as chat's ``image_url`` parts; a bad one is a 400
    naming its ``param``. Blocking: run it in ``ctx.offload``."""
    try:
        return ctx.engine.input_processor.load_images(parts)
    except MessageError as e:
        raise bad_request(str(e), e.param, code=e.code) from None


def _has_images(req: ChatCompletionRequest) -> bool:
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
               for m in req.messages)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request,
                                 ctx: ServingContext) -> Response:
    lora = await ctx.check_model(req.model)
    _check(req)
    tools = parse_tool_choice(req.tools, req.tool_choice, req.parallel_tool_calls)
    template_options(req, ctx.trust_request_chat_template)  # 400s before any CPU work
    images = await ctx.offload.run(chat_images, req, ctx) if _has_images(req) else None
    prompt, prompt_text = await ctx.offload.run(chat_prompt_ids, req, ctx, tools)  # bad -> 400
    parser = (ctx.reasoning_parser.for_prompt(prompt_text)
              if ctx.reasoning_parser is not None else None)
    # OpenAI's newer name wins; errors name the field the client sent.
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = getattr(req, max_tokens_param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, ctx, max_tokens=max_tokens, logprobs=logprobs,
                                   forced_constraint=forced_constraint(tools),
                                   max_tokens_param=max_tokens_param)
    # Structured output and forced tool calls constrain the answer, not the thinking.
    params.guided_decoding = after_reasoning(params.guided_decoding, parser, ctx.tokenizer)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    merged = merge_streams([ctx.generate(prompt, params, request_id, lora, req.priority,
                                         images=images)])
    model = lora.lora_name if lora is not None else ctx.model_name
    choices = [ChoiceState(reasoning=parser.streamer() if parser is not None else None)
               for _ in range(req.n)]
    if req.stream:
        first = await naming_context_errors(until_disconnect(anext(merged), raw), "messages",
                                            max_tokens_param)
        body = _stream(req, request_id, model, first, merged, choices, tools)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await naming_context_errors(until_disconnect(_collect(req, merged, choices), raw),
                                        "messages", max_tokens_param)
    response = ChatCompletionResponse(
        id=request_id, model=model, usage=_with_reasoning_tokens(usage, choices),
        choices=[_final_choice(k, c, tools) for k, c in enumerate(choices)])
    # Without a reasoning parser the reasoning fields are not part of the answer at all.
    exclude = None if parser is not None else {
        "choices": {"__all__": {"message": {"reasoning_content", "reasoning"}}}}
    return Response(response.model_dump_json(exclude=exclude), media_type="application/json")


def _with_reasoning_tokens(usage: UsageInfo, choices: list[ChoiceState]) -> UsageInfo:
    if choices and choices[0].reasoning is not None:
        usage.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=sum(c.reasoning_tokens for c in choices))
    return usage


def _final_choice(k: int, c: ChoiceState, tools: ToolChoice | None) -> ChatChoice:
    """A non-streamed choice: its text, or the tool calls found in / forced into it."""
    text, finish = "".join(c.texts), c.finish_reason
    thinking = "".join(c.reasonings) or None
    # A reasoning model cut off while thinking has no answer (null, as for a tool-only turn).
    content: str | None = text if text or thinking is None else None
    calls: list[dict[str, Any]] = []
    if tools is not None and tools.mode == "named":
        content, calls = None, forced_calls(tools, text)
    elif tools is not None and tools.mode == "required":
        calls = forced_calls(tools, text)
        content = None if calls else text
    elif tools is not None and tools.mode == "auto":
        content, calls = parse_auto(text, tools.names)
        calls = calls if tools.parallel else calls[:1]
    if calls and finish == "stop" and (tools.mode != "named"):  # type: ignore[union-attr]
        finish = "tool_calls"
    message = ChatResponseMessage(content=content,
                                  tool_calls=[ToolCall(**call) for call in calls] or None,
                                  reasoning_content=thinking, reasoning=thinking)
    return ChatChoice(index=k, message=message, logprobs=c.logprobs, finish_reason=finish,
                      stop_reason=c.stop_reason)


def _apply(req: ChatCompletionRequest, out: RequestOutput, choices: list[ChoiceState]):
    """Fold one engine output into the choices; return (index, new thinking, new answer text,
    logprobs, finish)."""
    check_output(out)
    updates = []
    for comp in out.outputs:
        choice = choices[comp.index]
        thinking, text = choice.split(comp.text, len(comp.token_ids),
                                      comp.finish_reason is not None)
        choice.texts.append(text)
        choice.reasonings.append(thinking)
        new_lp = chat_logprobs(comp.logprobs) if req.logprobs and comp.logprobs else None
        if new_lp is not None:
            if choice.logprobs is None:
                choice.logprobs = ChatLogprobs(content=[])
            choice.logprobs.content.extend(new_lp.content or [])  # type: ignore[union-attr]
        if comp.finish_reason is not None:
            choice.finish_reason = comp.finish_reason
            choice.stop_reason = comp.stop_reason
        updates.append((comp.index, thinking, text, new_lp, comp.finish_reason))
    return updates


async def _collect(req: ChatCompletionRequest, merged: AsyncIterator, choices: list[ChoiceState]):
    usage = UsageCounter()
    async for i, out in merged:
        usage.add(i, out)
        _apply(req, out, choices)
    if req.logprobs:
        for c in choices:
            c.logprobs = c.logprobs or ChatLogprobs(content=[])
    return usage.usage()


def tool_call_deltas(choice: ChoiceState, text: str, finish: str | None,
                 tools: ToolChoice) -> tuple[list[DeltaMessage], str | None]:
    """The deltas one engine update of ``choice`` becomes when tools are involved."""
    deltas: list[DeltaMessage] = []
    if tools.mode == "named":
        if text or (finish is not None and choice.call_id is None):
            if choice.call_id is None:
                call = new_call(tools.name, text)  # type: ignore[arg-type]
                choice.call_id = call["id"]
                deltas.append(DeltaMessage(tool_calls=[{"index": 0, **call}]))
            else:
                deltas.append(DeltaMessage(tool_calls=[
                    {"index": 0, "function": {"arguments": text}}]))
        return deltas, finish
    if tools.mode == "required":
        if finish is None:
            return deltas, None
        calls = forced_calls(tools, "".join(choice.texts))
        if not calls:
            return [DeltaMessage(content="".join(choice.texts))], finish
        return ([DeltaMessage(tool_calls=[{"index": i, **c} for i, c in enumerate(calls)])],
                "tool_calls" if finish == "stop" else finish)
    stream = choice.tool_stream = choice.tool_stream or AutoToolStream(tools.names)
    content = stream.feed(text)
    if content:
        deltas.append(DeltaMessage(content=content))
    if finish is not None:
        rest, calls = stream.finish()
        if rest:
            deltas.append(DeltaMessage(content=rest))
        calls = calls if tools.parallel else calls[:1]
        if calls:
            deltas.append(DeltaMessage(tool_calls=[{"index": i, **c}
                                                   for i, c in enumerate(calls)]))
            finish = "tool_calls" if finish == "stop" else finish
    return deltas, finish


async def _stream(req: ChatCompletionRequest, request_id: str, model: str, first, merged,
                  choices: list[ChoiceState], tools: ToolChoice | None = None) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous, exclude = stream_usage_flags(req.stream_options)
    usage = UsageCounter()

    def chunk(k: int, delta: DeltaMessage, lp=None, finish=None) -> str:
        c = ChatCompletionChunk(
            id=request_id, created=created, model=model,
            choices=[ChatChunkChoice(index=k, delta=delta, logprobs=lp, finish_reason=finish,
                                     stop_reason=choices[k].stop_reason if finish else None)],
            usage=_with_reasoning_tokens(usage.usage(), choices) if continuous else None)
        return sse(c.model_dump_json(exclude=exclude))

    try:
        for k in range(len(choices)):
            yield chunk(k, DeltaMessage(role="assistant", content=""))
        item = first
        while True:
            _, out = item
            usage.add(0, out)
            for k, thinking, text, lp, finish in _apply(req, out, choices):
                deltas = ([DeltaMessage(reasoning_content=thinking, reasoning=thinking)]
                          if thinking else [])
                if tools is not None and tools.mode != "none":
                    answer, finish = tool_call_deltas(choices[k], text, finish, tools)
                    deltas.extend(answer)
                elif text:
                    deltas.append(DeltaMessage(content=text))
                for d, delta in enumerate(deltas):
                    last = d == len(deltas) - 1
                    yield chunk(k, delta, lp if d == 0 else None, finish if last else None)
                if not deltas and (lp is not None or finish is not None):
                    yield chunk(k, DeltaMessage(), lp, finish)
            try:
                item = await anext(merged)
            except StopAsyncIteration:
                break
        if include_usage:
            final = ChatCompletionChunk(id=request_id, created=created, model=model,
                                        choices=[],
                                        usage=_with_reasoning_tokens(usage.usage(), choices))
            yield sse(final.model_dump_json())
    except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band
        yield sse(json.dumps(from_exception(exc).body()))
    finally:
        await merged.aclose()
    yield SSE_DONE
