"""``--api_key``: the bearer-token check shared by ``blade_llm_server`` and ``blade_llm_router``."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from bladellm.http.errors import APIError


def api_key_check(api_key: str | None):
    """A FastAPI dependency: 401 unless the request sends ``Authorization: Bearer <api_key>``
    (no check when ``api_key`` is None)."""
    expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        got = hashlib.sha256(request.headers.get("authorization", "").encode()).digest()
        if not hmac.compare_digest(got, expected):  # constant time; lengths hidden by hashing
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer "
                                "<key>'.", "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check
