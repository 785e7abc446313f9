"""OpenAI's Responses API: ``POST /v1/responses`` and the stored responses'
``GET``/``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A request becomes a chat request (``responses_input.py``) and runs through the chat path's
template, tool-call and structured-output code; the engine's text is split into reasoning (when
the server has a reasoning parser) and answer, and the answer into text and function calls, by
the same functions as chat streaming, for both modes (so a stream and a plain response agree).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from bladellm.entrypoints.openai.protocol import ChatCompletionRequest
from bladellm.entrypoints.openai.protocol_responses import (
    DeletedResponse, InputTokensDetails, OutputTokensDetails, ResponseObject, ResponsesRequest,
    ResponseUsage)
from bladellm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from bladellm.entrypoints.openai.responses_events import OutputBuilder, new_id, sse_event
from bladellm.entrypoints.openai.responses_input import (
    ImagePart, chat_request, check_request, input_items, logprobs, with_ids)
from bladellm.entrypoints.openai.serving_chat import (
    ChoiceState, chat_prompt_ids, load_images, tool_call_deltas)
from bladellm.entrypoints.openai.serving_common import (
    SSE_HEADERS, ClientDisconnected, ServingContext, UsageCounter, build_sampling_params,
    chat_logprobs, check_output, merge_streams, naming_context_errors, until_disconnect)
from bladellm.entrypoints.openai.structured_output import after_reasoning
from bladellm.entrypoints.openai.tool_calls import (
    ToolChoice, forced_constraint, parse_tool_choice)
from bladellm.http.errors import APIError, bad_request, unsupported
from bladellm.http.handlers import from_exception
from bladellm.outputs import RequestOutput


@dataclass
class _Run:
    """One response in the making: engine outputs in, output items (and events) out. The
    thinking is split off (and its tokens counted) by the chat path's ``ChoiceState.split``."""

    builder: OutputBuilder
    tools: ToolChoice | None
    choice: ChoiceState
    usage: UsageCounter = field(default_factory=UsageCounter)

    def feed(self, out: RequestOutput) -> None:
        check_output(out)
        self.usage.add(0, out)
        comp = out.outputs[0]
        finish = comp.finish_reason
        thinking, answer = self.choice.split(comp.text, len(comp.token_ids), finish is not None)
        self.builder.reasoning(thinking)
        self.choice.texts.append(answer)
        if finish is not None:
            self.choice.finish_reason = finish
        if self.tools is None or self.tools.mode == "none":
            logprobs = None
            if comp.logprobs:  # asked for: every token is answer text (responses_input.py)
                logprobs = [t.model_dump(mode="json")
                            for t in chat_logprobs(comp.logprobs).content or []]
            self.builder.text(answer, logprobs=logprobs)
            return
        deltas, _ = tool_call_deltas(self.choice, answer, finish, self.tools)
        for delta in deltas:
            self.builder.text(delta.content or "")
            for call in delta.tool_calls or []:
                fn = call["function"]
                if "id" in call:
                    self.builder.call(call["id"], fn["name"], fn.get("arguments") or "")
                else:
                    self.builder.arguments(fn.get("arguments") or "")

    def finish(self) -> None:
        u = self.usage.usage()
        details = u.prompt_tokens_details
        reasoning = self.choice.reasoning_tokens
        self.builder.finish(self.choice.finish_reason, ResponseUsage(
            input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=details.cached_tokens if details else 0),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning)))


@dataclass
class ResponsesService:
    ctx: ServingContext
    store: ResponseStore

    async def create(self, req: ResponsesRequest, raw: Request,
                     ctx: ServingContext | None = None) -> Response:
        """``ctx``: the request's own (``ServingContext.for_request``), else the service's."""
        ctx = ctx or self.ctx
        lora = await ctx.check_model(req.model)
        check_request(req)
        history = self._history(req)
        # Off the loop: an input may hold hundreds of thousands of items.
        items, chat, tools, image_parts = await ctx.offload.run(
            _conversation, req, list(history.items) if history else [])
        # Before rendering: a text-only model's 400 names the first image part.
        images = await ctx.offload.run(load_images, image_parts, ctx) if image_parts else None
        prompt, prompt_text = await ctx.offload.run(_prompt, chat, ctx, tools)
        parser = (ctx.reasoning_parser.for_prompt(prompt_text)
                  if ctx.reasoning_parser is not None else None)
        num_logprobs = logprobs(req, may_think=parser is not None and not parser.closed_by_prompt,
                                has_tools=tools is not None and tools.mode != "none")
        params = _sampling_params(chat, ctx, tools, num_logprobs)
        # Structured output and forced tool calls constrain the answer, not the thinking.
        params.guided_decoding = after_reasoning(params.guided_decoding, parser, ctx.tokenizer)
        response = ResponseObject(
            id=new_id("resp"), model=lora.lora_name if lora is not None else ctx.model_name,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning,
            store=req.store and self.store.enabled, temperature=req.temperature,
            top_p=req.top_p, user=req.user, tool_choice=req.tool_choice or "auto",
            tools=[t.model_dump(mode="json", exclude_none=True) for t in req.tools or []],
            text=req.text.model_dump(mode="json", by_alias=True, exclude_none=True)
            if req.text is not None and req.text.format is not None else
            {"format": {"type": "text"}}, priority=req.priority)
        run = _Run(OutputBuilder(response), tools,
                   ChoiceState(reasoning=parser.streamer() if parser is not None else None))
        merged = merge_streams([ctx.generate(prompt, params, response.id, lora, req.priority,
                                             images=images)])
        if req.stream:
            first = await naming_context_errors(until_disconnect(anext(merged), raw), "input",
                                                "max_output_tokens")
            body = self._stream(run, first, merged, items, history)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        await naming_context_errors(until_disconnect(self._collect(run, merged), raw),
                                    "input", "max_output_tokens")
        await self._keep(run, items, history)
        return Response(response.model_dump_json(), media_type="application/json")

    def _history(self, req: ResponsesRequest) -> StoredResponse | None:
        if req.previous_response_id is None:
            return None
        entry = self.store.get(req.previous_response_id)
        if entry is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not "
                                f"found.", param="previous_response_id",
                           code="previous_response_not_found")
        return entry

    async def _keep(self, run: _Run, items: list[dict[str, Any]],
                    history: StoredResponse | None) -> None:
        response = run.builder.response
        if response.store:
            output = [item.model_dump(mode="json") for item in response.output]
            earlier = len(history.items) if history else 0
            # Sized off the loop: an input of many items is tens of MiB of JSON.
            size = await self.ctx.offload.run(_json_size, response, items[earlier:] + output)
            size += history.size if history else 0
            self.store.put(StoredResponse(response, items + output, len(items), size))

    @staticmethod
    async def _collect(run: _Run, merged: AsyncIterator) -> None:
        async for _, out in merged:
            run.feed(out)
            run.builder.events.clear()
        run.finish()

    async def _stream(self, run: _Run, first: Any, merged: AsyncIterator,
                      items: list[dict[str, Any]],
                      history: StoredResponse | None) -> AsyncIterator[str]:
        builder = run.builder
        try:
            builder.start()
            item = first
            while True:
                run.feed(item[1])
                for event in builder.events:
                    yield sse_event(event)
                builder.events.clear()
                try:
                    item = await anext(merged)
                except StopAsyncIteration:
                    break
            run.finish()
            await self._keep(run, items, history)
        except Exception as exc:  # noqa: BLE001 - mid-stream failure: tell the client in-band
            # Events made before the failure still go out: sequence numbers have no gaps.
            builder.fail(from_exception(exc).message)
        finally:
            await merged.aclose()
        for event in builder.events:
            yield sse_event(event)

    # ------------------------------------------------------------------ stored responses

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="response_id", code="response_not_found")
        return entry

    def retrieve(self, response_id: str) -> Response:
        return _json(self._stored(response_id).response.model_dump_json())

    def delete(self, response_id: str) -> Response:
        self._stored(response_id)
        self.store.delete(response_id)
        return _json(DeletedResponse(id=response_id).model_dump_json())

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc",
                    after: str | None = None, include: list[str] | None = None) -> Response:
        """OpenAI's ``GET /v1/responses/{id}/input_items``: the items the model saw as input
        (earlier turns of a ``previous_response_id`` chain included), a page at a time."""
        entry = self._stored(response_id)
        if not 1 <= limit <= 100:
            raise bad_request(f"limit: must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", "order")
        if include:
            raise unsupported("include", "include on input_items")
        items = entry.items[:entry.num_input]
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item {after!r} in this response", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return _json(json.dumps({
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}))

    def cancel(self, response_id: str) -> Response:
        self._stored(response_id)  # 404 first, as OpenAI
        raise APIError(400, "Only responses created with background=true can be cancelled.",
                       param="response_id", code="response_not_cancellable")


def _json_size(response: ResponseObject, items: list[dict[str, Any]]) -> int:
    return len(response.model_dump_json()) + len(json.dumps(items))


def _json(body: str) -> Response:
    return Response(body, media_type="application/json")


def _conversation(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> tuple[
        list[dict[str, Any]], ChatCompletionRequest, ToolChoice | None, list[ImagePart]]:
    """The conversation's items (earlier turns, then this input), the chat request and tool
    choice they make, and its image parts in prompt order (earlier turns' included)."""
    items = earlier + with_ids(input_items(req))
    image_parts: list[ImagePart] = []
    chat = chat_request(req, items, image_parts, first_input=len(earlier))
    tools = parse_tool_choice(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    return items, chat, tools, image_parts


def _prompt(chat: ChatCompletionRequest, ctx: ServingContext,
            tools: ToolChoice | None) -> tuple[list[int], str]:
    """The chat path's rendering; its errors name ``messages``, which here is ``input``."""
    try:
        return chat_prompt_ids(chat, ctx, tools)
    except APIError as exc:
        if exc.param and exc.param.startswith("messages"):
            exc.param = "input"
        raise
    except ValueError as exc:  # the template itself failed ("messages: chat template ...")
        raise bad_request(str(exc).replace("messages:", "input:", 1), "input") from None


def _sampling_params(chat: ChatCompletionRequest, ctx: ServingContext,
                     tools: ToolChoice | None, num_logprobs: int | None) -> Any:
    try:
        return build_sampling_params(chat, ctx, max_tokens=chat.max_completion_tokens,
                                     logprobs=num_logprobs,
                                     forced_constraint=forced_constraint(tools),
                                     max_tokens_param="max_output_tokens")
    except APIError as exc:  # structured-output errors name the chat field
        if exc.param == "response_format":
            exc.param = "text.format"
            exc.message = exc.message.replace("response_format.json_schema", "text.format")
            exc.message = exc.message.replace("response_format", "text.format")
        raise


def add_responses_routes(router: APIRouter, ctx: ServingContext, server_config: Any,
                         serve: Callable[[Request, type, Any], Awaitable[Response]]) -> None:
    """The Responses routes, with their own store (one per app). ``serve``: the app's POST
    path (api_server.py), which parses the body off the event loop like every other POST."""
    service = ResponsesService(ctx, ResponseStore(server_config.responses_store_max_entries,
                                                  server_config.responses_store_ttl,
                                                  server_config.responses_store_bytes))
    retry_after = server_config.retry_after

    async def guarded(work: Any) -> Response:
        try:
            return await work()
        except (ClientDisconnected, ClientDisconnect):
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
            return from_exception(exc, retry_after).response()

    async def create(req: ResponsesRequest, raw: Request, request_ctx: ServingContext) -> Response:
        return await service.create(req, raw, request_ctx)

    @router.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await serve(request, ResponsesRequest, create)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return await guarded(_sync(service.retrieve, response_id))

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None,
                               include: list[str] | None = Query(None)) -> Response:
        return await guarded(_sync(service.input_items, response_id, limit, order, after,
                                   include))

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await guarded(_sync(service.delete, response_id))

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await guarded(_sync(service.cancel, response_id))


def _sync(fn: Any, *args: Any) -> Any:
    async def work() -> Response:
        return fn(*args)
    return work

