"""POST /v1/completions: string, list-of-strings or token-id prompts; n, echo, logprobs, stream."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from bladellm.errors import ContextLengthError
from bladellm.entrypoints.openai import prompt_logprobs as prompt_lp
from bladellm.http.errors import bad_request, unsupported
from bladellm.http.handlers import from_exception
from bladellm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse)
from bladellm.entrypoints.openai.serving_common import (
    SSE_DONE, SSE_HEADERS, ServingContext, UsageCounter, build_sampling_params, check_output,
    completion_logprobs, context_length_error, merge_streams,
    naming_context_errors,
    reject_unsupported, sse, stream_usage_flags, until_disconnect)
from bladellm.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions


@dataclass
class _Choice:
    echo: str = ""
    texts: list[str] = field(default_factory=list)
    length: int = 0  # characters sent so far, echo included (for text_offset)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it
    prompt_lp: CompletionLogprobs | None = None  # echo + logprobs: the prompt's part
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs (sent once)


def _prompts(req: CompletionRequest, max_prompts: int) -> list[str | list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompts: list[str | list[int]] = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if len(prompts) > max_prompts:
        raise bad_request(f"prompt: at most {max_prompts} prompts per request "
                          f"(--max_prompts_per_request), got {len(prompts)}", "prompt")
    return prompts  # their tokens and lengths: InputProcessor's checks, in the engine


def _check(req: CompletionRequest) -> None:
    reject_unsupported(req)
    if req.suffix is not None:
        raise unsupported("suffix")
    prompt_lp.check(req.prompt_logprobs)


async def create_completion(req: CompletionRequest, raw: Request,
                            ctx: ServingContext) -> Response:
    lora = await ctx.check_model(req.model)
    _check(req)
    prompts = _prompts(req, ctx.max_prompts_per_request)
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = build_sampling_params(req, ctx, max_tokens=max_tokens, logprobs=req.logprobs)
    echo_top = req.logprobs if (req.echo and req.logprobs is not None) else None
    if req.prompt_logprobs is not None or echo_top is not None:
        # From each prompt's own prefill; they come with its first output (_fold_prompt_logprobs).
        params = params.clone(prompt_logprobs=max(req.prompt_logprobs or 0, echo_top or 0))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = [ctx.generate(p, params, f"{request_id}-p{i}", lora, req.priority)
               for i, p in enumerate(prompts)]
    merged = merge_streams(streams)
    choices = [_Choice() for _ in range(len(prompts) * req.n)]
    if req.echo:
        for i, p in enumerate(prompts):
            # Decoding a long token-id prompt is CPU work: off the event loop.
            text = p if isinstance(p, str) else await ctx.offload.run(ctx.tokenizer.decode, p)
            for j in range(req.n):
                choices[i * req.n + j].echo = text
    model = lora.lora_name if lora is not None else ctx.model_name
    if req.stream:
        first = await naming_context_errors(until_disconnect(anext(merged), raw), "prompt")
        body = _stream(req, request_id, model, first, merged, choices, ctx)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    usage = await naming_context_errors(
        until_disconnect(_collect(req, merged, choices, ctx), raw), "prompt")
    response = CompletionResponse(
        id=request_id, model=model, usage=usage,
        choices=[CompletionChoice(index=k, text=c.echo + "".join(c.texts), logprobs=c.logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  prompt_logprobs=c.prompt_logprobs)
                 for k, c in enumerate(choices)])
    return Response(response.model_dump_json(), media_type="application/json")


def _apply(req: CompletionRequest, stream_idx: int, out: RequestOutput, choices: list[_Choice],
           ctx: ServingContext) -> list[tuple[int, str, CompletionLogprobs | None, str | None]]:
    """Fold one engine output into the choices; return (index, new text, new logprobs, finish)."""
    check_output(out)
    if out.prompt_logprobs is not None:
        _fold_prompt_logprobs(req, stream_idx, out, choices, ctx)
    updates = []
    for comp in out.outputs:
        k = stream_idx * req.n + comp.index
        choice = choices[k]
        text = comp.text
        first_with_echo = choice.length == 0 and bool(choice.echo)
        if first_with_echo:
            choice.length = len(choice.echo)
            text = choice.echo + text
            offset = len(choice.echo)
        else:
            offset = choice.length
        choice.texts.append(comp.text)
        new_lp = None
        if req.logprobs is not None and comp.logprobs:
            new_lp = completion_logprobs(comp.logprobs, offset)
            choice.logprobs = completion_logprobs(comp.logprobs, offset, choice.logprobs)
        if first_with_echo and choice.prompt_lp is not None:  # the prompt's logprobs lead
            new_lp = completion_logprobs([], 0, choice.prompt_lp.model_copy(deep=True)) \
                if new_lp is None else _concat(choice.prompt_lp, new_lp)
        choice.length = offset + len(comp.text)
        if comp.finish_reason is not None:
            choice.finish_reason = comp.finish_reason
            choice.stop_reason = comp.stop_reason
        updates.append((k, text, new_lp, comp.finish_reason))
    return updates


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def _fold_prompt_logprobs(req: CompletionRequest, stream_idx: int, out: RequestOutput,
                          choices: list[_Choice], ctx: ServingContext) -> None:
    """A prompt's logprobs (with its stream's first output) into the choices of that prompt:
    vLLM's ``prompt_logprobs`` and, for echo with logprobs, the lead of ``logprobs``."""
    entries = out.prompt_logprobs[1:]  # type: ignore[index]
    vllm = None
    if req.prompt_logprobs is not None:
        vllm = prompt_lp.vllm_format([e[:1 + req.prompt_logprobs] for e in entries])
    echo = None
    if req.echo and req.logprobs is not None:
        echo = prompt_lp.echo_logprobs(out.prompt_token_ids, entries, ctx, req.logprobs)
    for j in range(req.n):
        choice = choices[stream_idx * req.n + j]
        choice.prompt_logprobs = vllm
        if echo is not None:
            choice.prompt_lp = echo
            choice.logprobs = echo.model_copy(deep=True)


async def _collect(req: CompletionRequest, merged: AsyncIterator, choices: list[_Choice],
                   ctx: ServingContext):
    usage = UsageCounter()
    async for i, out in merged:
        usage.add(i, out)
        _apply(req, i, out, choices, ctx)
    if req.logprobs is not None:
        for c in choices:
            c.logprobs = c.logprobs or CompletionLogprobs()
    return usage.usage()


async def _stream(req: CompletionRequest, request_id: str, model: str, first, merged,
                  choices: list[_Choice], ctx: ServingContext) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage, continuous, exclude = stream_usage_flags(req.stream_options)
    usage = UsageCounter()

    def chunk(k: int, text: str, lp, finish) -> str:
        # vLLM sends prompt_logprobs once, in a choice's first chunk.
        plp, choices[k].prompt_logprobs = choices[k].prompt_logprobs, None
        c = CompletionChunk(id=request_id, created=created, model=model,
                            choices=[CompletionChoice(index=k, text=text, logprobs=lp,
                                                      finish_reason=finish,
                                                      stop_reason=choices[k].stop_reason
                                                      if finish else None,
                                                      prompt_logprobs=plp)],
                            usage=usage.usage() if continuous else None)
        return sse(c.model_dump_json(exclude=exclude))

    try:
        item = first
        while True:
            i, out = item
            usage.add(i, out)
            for k, text, lp, finish in _apply(req, i, out, choices, ctx):
                if text or lp is not None or finish is not None:
                    yield chunk(k, text, lp, finish)
            try:
                item = await anext(merged)
            except StopAsyncIteration:
                break
        if include_usage:
            final = CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                    usage=usage.usage())
            yield sse(final.model_dump_json())
    except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band
        yield sse(_error_json(exc))
    finally:
        await merged.aclose()
    yield SSE_DONE


def _error_json(exc: Exception) -> str:
    if isinstance(exc, ContextLengthError):  # a later prompt of a batch did not fit
        return json.dumps(context_length_error(exc, "prompt").body())
    return json.dumps(from_exception(exc).body())
