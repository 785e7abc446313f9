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
    or, as Anthropic's clients do, ``x-api-key: <api_key>`` (no check when ``api_key`` is
    None)."""
    expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key else None
    expected_key = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        got = hashlib.sha256(_canonical(request.headers.get("authorization", ""))).digest()
        # Both compared, always: constant time; lengths hidden by hashing.
        bearer_ok = hmac.compare_digest(got, expected)
        got_key = hashlib.sha256(request.headers.get("x-api-key", "").encode()).digest()
        key_ok = hmac.compare_digest(got_key, expected_key)  # type: ignore[arg-type]
        if not (bearer_ok or key_ok):
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer "
                                "<key>' (or 'x-api-key: <key>').", "invalid_request_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
