"""Exception handlers: what a FastAPI app answers for an exception raised while serving a
request, as an ``APIError`` body; pydantic's 422 becomes 400, as in OpenAI's API."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bladellm.errors import (
    EngineDeadError, EngineOverloadedError, RequestFailedError, ServerShuttingDownError)
from bladellm.http.errors import APIError, bad_request, shutting_down

logger = logging.getLogger(__name__)


def _param_of(message: str) -> str | None:
    # SamplingParams and the configs say "name: message".
    head, sep, _ = message.partition(":")
    if sep and head.replace("_", "").isalnum():
        return head.lstrip("-")
    return None


def from_exception(exc: BaseException, retry_after: int = 1) -> APIError:
    """Map an exception raised while serving a request to the error the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_errors(exc.errors())
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=_param_of(str(exc)))
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc) or "The server is overloaded; retry later.",
                        "server_error", code="overloaded",
                        headers={"Retry-After": str(retry_after)})
    if isinstance(exc, ServerShuttingDownError):
        return shutting_down(str(exc), retry_after)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}", "server_error",
                        code="engine_dead", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"The request failed in the engine: {exc}", "server_error",
                        code="request_failed")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", "server_error",
                    code="internal_error")


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's error list into one OpenAI-style 400."""
    if not errors:
        return bad_request("Invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    is_union = any(_is_type_tag(p) for p in loc)
    if is_union:  # pydantic tags union members in the location ("prompt", "list[int]", 0)
        loc = loc[:next(i for i, p in enumerate(loc) if _is_type_tag(p))]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if is_union and param:
        return bad_request(f"{param}: invalid type or value ({first.get('msg', '')})",
                           param=param, code="invalid_type")
    if kind == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {first.get('msg', '')}",
                           code="invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param,
                           code="unrecognized_argument")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    msg = first.get("msg", "invalid value")
    if kind == "value_error":  # our own validators: drop pydantic's "Value error, " prefix
        msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return bad_request(f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param,
                       code="invalid_value")


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


def install_handlers(app: FastAPI) -> None:
    retry_after = getattr(app.state, "retry_after", 1)

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc, retry_after).response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (RequestValidationError, ValidationError))
        return from_validation_errors(list(exc.errors())).response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        phrase = HTTPStatus(exc.status_code).phrase
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        return APIError(exc.status_code, detail, type_, code=phrase.lower().replace(" ", "_"),
                        headers=getattr(exc, "headers", None)).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for exc_type in (ValueError, EngineOverloadedError, EngineDeadError, RequestFailedError,
                     ServerShuttingDownError):
        app.add_exception_handler(exc_type, api_error)
    app.add_exception_handler(Exception, api_error)
