"""Typed errors the front end maps to HTTP status codes."""


class EngineDeadError(RuntimeError):
    """The engine core died; every pending and future request fails with this (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full or a request waited past --max_queue_time (HTTP 503 + Retry-After)."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; the engine keeps serving (HTTP 500)."""


class ServerShuttingDownError(RuntimeError):
    """The server is stopping and the request did not finish within --shutdown_timeout
    (HTTP 503: the client may retry on another replica)."""
