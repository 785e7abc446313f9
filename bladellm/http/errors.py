"""Error responses: every error leaves a server or the router as
``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape, which clients of both
expect) with the status code OpenAI would use. ``handlers.py`` maps exceptions to them.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, what: str | None = None) -> APIError:
    return bad_request(f"{what or param} is not supported by this server", param=param,
                       code="unsupported_parameter")


def shutting_down(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, f"The server is shutting down: {message}", "server_error",
                    code="server_shutting_down", headers={"Retry-After": str(retry_after)})
