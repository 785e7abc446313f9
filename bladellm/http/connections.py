"""Connection hygiene for the servers' uvicorn: no connection may hold a socket forever.

- A request's line and headers must arrive within ``header_timeout`` seconds of the connection
  (or of the first byte of the next request on a kept-alive one); a body may pause at most
  ``body_timeout`` seconds between two reads; an idle kept-alive connection closes after
  ``keep_alive_timeout`` (uvicorn's own timer). A slow sender is closed, not waited for.
- At most ``max_connections`` connections are open at once: the next one gets an immediate
  OpenAI-style 503 and is closed, before the process runs out of file descriptors.
- ``raise_open_file_limit`` lifts the soft open-file limit to the hard one at start-up (the
  usual soft default of 1,024 is far below what a busy server holds).
- ``CountedNotes``: the closes above are logged once per interval with a count, not once per
  connection.
- ``RateLimitedErrors``: the event loop's error reports (accept() failing with "Too many open
  files" repeats for as long as the condition lasts) logged once per interval per kind, with a
  count of the ones held back.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_TICK_S = 0.5  # how often a connection checks its deadlines


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 4096
    retry_after: int = 1

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--http_{name}: must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"--max_connections: must be >= 1, got {self.max_connections}")


@dataclass
class ConnectionFlags:
    """The four connection flags, shared by ``blade_llm_server``'s and ``blade_llm_router``'s
    configs (both inherit them, so the flags, defaults and help are one definition)."""

    http_header_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds a connection has to send a request's line and headers "
                          "(from its opening, or from the first byte of its next request); "
                          "slower ones are closed."})
    http_body_timeout: float = field(
        default=60.0,
        metadata={"help": "Seconds a request body may pause between two reads before the "
                          "connection is closed."})
    http_keep_alive_timeout: float = field(
        default=5.0,
        metadata={"help": "Seconds an idle kept-alive client connection stays open."})
    max_connections: int = field(
        default=4096,
        metadata={"help": "Most open client connections; the next one gets HTTP 503 and is "
                          "closed. Lowered at start-up to fit the open-file limit (whose soft "
                          "value is raised to the hard one)."})

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The four flags, validated (ValueError naming the flag)."""
        return ConnectionLimits(self.http_header_timeout, self.http_body_timeout,
                                self.http_keep_alive_timeout, self.max_connections)


def _busy_response(retry_after: int) -> bytes:
    body = json.dumps({"error": {
        "message": "The server has too many open connections; retry later.",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {retry_after}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the deadlines and the connection cap above."""
    # Imported here: the flags (ConnectionLimits) are parsed before uvicorn is loaded.
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    busy = _busy_response(limits.retry_after)
    # One line per interval, not per connection: a client holding thousands of sockets must
    # not turn into as many log lines.
    closes = CountedNotes()

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _request_started: float | None
        _last_data: float
        _seen_cycle: Any
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            now = self.loop.time()
            self._request_started, self._last_data, self._seen_cycle = now, now, None
            if len(self.connections) > limits.max_connections:
                transport.write(busy)
                transport.close()
                return
            self._timer = self.loop.call_later(_TICK_S, self._check_deadlines)

        def data_received(self, data: bytes) -> None:
            now = self.loop.time()
            self._last_data = now
            if self._request_started is None and (self.cycle is None
                                                  or self.cycle.response_complete):
                self._request_started = now  # the first byte of the next request
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:
                self._seen_cycle = self.cycle  # its headers are complete
                self._request_started = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def _check_deadlines(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            now = self.loop.time()
            cycle = self.cycle
            if self._request_started is not None:
                if now - self._request_started > limits.header_timeout:
                    closes.note("connections closed: request headers did not arrive within "
                                f"{limits.header_timeout:g} s (--http_header_timeout)")
                    self.transport.close()
                    return
            elif (cycle is not None and cycle.more_body and not cycle.response_complete
                  and now - self._last_data > limits.body_timeout):
                closes.note("connections closed: request body paused for more than "
                            f"{limits.body_timeout:g} s (--http_body_timeout)")
                self.transport.close()
                return
            self._timer = self.loop.call_later(_TICK_S, self._check_deadlines)

    return GuardedHTTPProtocol


def uvicorn_limits(limits: ConnectionLimits) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that carry ``limits``."""
    return {"http": guarded_protocol(limits), "timeout_keep_alive": limits.keep_alive_timeout}


def raise_open_file_limit(cap: int = 1 << 20) -> int:
    """Soft open-file limit up to the hard limit (at most ``cap``); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return cap if soft == resource.RLIM_INFINITY else soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return soft
    logger.info("open-file limit raised from %d to %d", soft, target)
    return target


def effective_max_connections(limits: ConnectionLimits, open_file_limit: int,
                              reserve: int = 128) -> ConnectionLimits:
    """``limits`` with ``max_connections`` below the open-file limit (the process needs
    ``reserve`` descriptors of its own): past it, accept() would fail instead of a 503."""
    room = max(1, open_file_limit - reserve)
    if limits.max_connections <= room:
        return limits
    logger.warning("--max_connections %d lowered to %d: the open-file limit is %d",
                   limits.max_connections, room, open_file_limit)
    return ConnectionLimits(limits.header_timeout, limits.body_timeout,
                            limits.keep_alive_timeout, room, limits.retry_after)


class RateLimitedErrors:
    """An event-loop exception handler that logs each kind of report (its message) at most
    once per ``interval`` seconds, saying how many were held back since the last one."""

    def __init__(self, interval: float = 10.0, clock: Any = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        key = str(context.get("message", "unhandled error in the event loop"))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._last[key] = now
        held = self._held.pop(key, 0)
        more = f" ({held} more like it in the last {self.interval:g} s)" if held else ""
        exc = context.get("exception")
        # Running out of descriptors under a connection flood is a condition, not a bug: its
        # message says all there is, and a traceback per kind would only add log volume.
        exhausted = isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)
        logger.error("%s%s: %s", key, more, exc if exc is not None else context,
                     exc_info=exc if last is None and not exhausted else None)


class CountedNotes:
    """INFO lines that would repeat once per connection, logged at most once per ``interval``
    seconds per kind with how many happened since the last line."""

    def __init__(self, interval: float = 10.0, clock: Any = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, what: str) -> None:
        now = self.clock()
        self._count[what] = self._count.get(what, 0) + 1
        last = self._last.get(what)
        if last is not None and now - last < self.interval:
            return
        since = "" if last is None else f" in the last {now - last:.0f} s"
        logger.info("%s: %d%s", what, self._count.pop(what), since)
        self._last[what] = now
