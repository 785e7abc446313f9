"""``--api_key``: the bearer-token check shared by ``blade_llm_server`` and ``blade_llm_router``."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from bladellm.http.errors import APIError


def _canonical(authorization: str) -> bytes:
    """The header with its scheme spelled ``Bearer``: RFC 9110 makes the scheme
    case-insensitive (clients send ``bearer``)."""
    scheme, sep, credentials = authorization.partition(" ")
    if sep and scheme.lower() == "bearer":
        return f"Bearer {credentials.strip()}".encode()
    return authorization.encode()


def api_key_check(api_key: str | None):
    """A FastAPI dependency: 401 unless the request sends ``Authorization: Bearer <api_key>``
    (no check when ``api_key`` is None)."""
    expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        got = hashlib.sha256(_canonical(request.headers.get("authorization", ""))).digest()
        if not hmac.compare_digest(got, expected):  # constant time; lengths hidden by hashing
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer "
                                "<key>'.", "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check
