"""Request-body size limit shared by the server and the router: 413 for a body over the limit,
by Content-Length up front or by counting the chunks as they arrive (a chunked upload has no
length), before anything buffers it whole."""

from __future__ import annotations

from typing import Any

from bladellm.http.errors import APIError


class RequestTooLarge(Exception):
    pass


def too_large(max_bytes: int) -> APIError:
    # The connection closes after the answer: kept alive, the server would go on reading
    # (and discarding) whatever the client still sends of the body, however much that is.
    return APIError(413, f"Request body is larger than the {max_bytes}-byte limit.",
                    "invalid_request_error", code="request_too_large",
                    headers={"connection": "close"})


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length up front or by counting chunks."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _reject(self) -> APIError:
        return too_large(self.max_bytes)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await self._reject().response()(scope, receive, send)
                    return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge()
            return message

        await self.app(scope, limited_receive, send)
