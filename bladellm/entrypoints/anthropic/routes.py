"""The Messages routes, mounted by the server's ``build_app`` on its ``/v1`` router (so behind
``--api_key``, which also accepts Anthropic's ``x-api-key`` header), with the middleware that
gives every error on these paths Anthropic's shape. The ``anthropic-version`` and
``anthropic-beta`` headers are accepted; no beta feature changes what is served."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from bladellm.http.anthropic_errors import AnthropicErrors
from bladellm.entrypoints.anthropic.protocol import (
    CountTokensRequest, CountTokensResponse, MessageResponse, MessagesRequest)
from bladellm.entrypoints.anthropic.serving import count_tokens, create_message

# The server's request runner: (request, body model, handler) -> response, errors included.
Serve = Callable[[Request, type, Any], Awaitable[Response]]


def add_anthropic_routes(app: FastAPI, router: APIRouter, serve: Serve) -> None:
    """Call before ``app.include_router(router)`` and after the app's other middlewares (this
    one must be outermost to see their errors too)."""
    app.add_middleware(AnthropicErrors)

    @router.post("/v1/messages", openapi_extra=_io(MessagesRequest, MessageResponse),
                 summary="Anthropic Messages")
    async def messages(request: Request) -> Response:
        return await serve(request, MessagesRequest, create_message)

    @router.post("/v1/messages/count_tokens",
                 openapi_extra=_io(CountTokensRequest, CountTokensResponse),
                 summary="Anthropic Messages: count tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await serve(request, CountTokensRequest, count_tokens)


def _io(request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """The route's body and answer for /openapi.json (the handler parses the body itself, so
    that the server's own error handling applies)."""
    return {"requestBody": {"required": True, "content": {
                "application/json": {"schema": inline_schema(request)}}},
            "responses": {"200": {"description": "OK", "content": {
                "application/json": {"schema": inline_schema(response, "serialization")}}}}}


def inline_schema(model: type[BaseModel], mode: str = "validation") -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` inlined (an OpenAPI operation cannot carry
    ``$defs`` of its own; the models are not recursive)."""
    schema = model.model_json_schema(mode=mode)  # type: ignore[arg-type]
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
