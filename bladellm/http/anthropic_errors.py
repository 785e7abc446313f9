"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

The server's handlers, its auth check and its middlewares (body limit, shutdown) all answer in
OpenAI's shape; ``AnthropicErrors`` rewrites every error response on the Messages paths, so that
each of them, whoever raised it, reaches an Anthropic client as the SDK expects it. Status codes
follow Anthropic's: a full queue is 529 ``overloaded_error``.

Here in ``http/`` (shared by the server and ``blade_llm_router``): the router answers its own
errors on the Messages paths (no instance, timeout, body too large, API key) in this shape too.
"""

from __future__ import annotations

import json
from typing import Any

from bladellm.http.errors import APIError

PATHS = ("/v1/messages", "/v1/messages/count_tokens")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 504: "timeout_error", 529: "overloaded_error"}
OVERLOADED = 529


def anthropic_error(status: int, message: str, code: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape; ``code``: the OpenAI error code, which
    tells a full queue (503 ``overloaded``: Anthropic's 529) from a stopping server (503)."""
    if status == 503 and code == "overloaded":
        status = OVERLOADED
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def from_api_error(err: APIError) -> tuple[int, dict]:
    return anthropic_error(err.status, err.message, err.code)


def _rewrite(status: int, body: bytes) -> tuple[int, bytes]:
    try:
        error = json.loads(body)["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = body.decode("utf-8", "replace") or f"HTTP {status}", None
    status, new = anthropic_error(status, message, code)
    return status, json.dumps(new).encode()


class AnthropicErrors:
    """ASGI middleware: on the Messages paths, an error response (status >= 400, JSON) is
    re-sent in Anthropic's shape; everything else passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] != "http" or path.rstrip("/") not in PATHS:
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 \
                    and _is_json(message.get("headers", ())):
                start = message
                return
            if start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = _rewrite(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", ())
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)


def _is_json(headers: Any) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json")
               for k, v in headers)
