"""Graceful shutdown and engine death, seen from the HTTP side.

``Lifecycle`` counts the HTTP requests in flight (an ASGI middleware, so a streaming response
counts until its last byte) and, once draining, refuses new ones with 503
``server_shutting_down`` (``/metrics`` stays open). ``drain`` is what SIGTERM/SIGINT start:

1. refuse new requests; in-flight ones get ``grace`` seconds (``--shutdown_timeout``) to finish;
2. then each one still running is finished by the engine with ``ServerShuttingDownError``, so its
   client gets an OpenAI error body (503) or, mid-stream, a final ``data: {"error": ...}`` event
   and ``data: [DONE]``: never a cut connection or a traceback;
3. after at most ``FLUSH_S`` more seconds for those responses to go out, uvicorn is told to exit.

``watch_engine`` turns a dead engine core into a process exit (status 1) after a short drain, as
orchestrators expect from a server that cannot serve any more; ``--keep_serving_on_engine_death``
keeps answering 503 instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from bladellm.http.errors import shutting_down

logger = logging.getLogger("bladellm.server")

FLUSH_S = 1.0  # after failing the stragglers, time for their error responses to be written
ENGINE_POLL_S = 0.2
_ALWAYS_OPEN = ("/metrics",)


class Lifecycle:
    def __init__(self, retry_after: int = 1) -> None:
        self.retry_after = retry_after
        self.in_flight = 0
        self.draining = False
        self._idle: asyncio.Event | None = None

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        self.in_flight += 1
        self._idle_event().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle_event().set()

    async def wait_idle(self, timeout: float) -> bool:
        """True if no request is in flight within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._idle_event().wait(), timeout=max(timeout, 0.0))
            return True
        except asyncio.TimeoutError:
            return self.in_flight == 0

    async def drain(self, engine: Any, grace: float) -> None:
        """Steps 1-3 of the module docstring; returns when uvicorn may exit."""
        self.draining = True
        start = time.monotonic()
        logger.info("shutting down: refusing new requests, %d in flight get %.1f s to finish",
                    self.in_flight, grace)
        if not await self.wait_idle(grace):
            failed = engine.fail_all(f"the request did not finish within the {grace:g} s "
                                     f"shutdown grace period")
            logger.info("grace period over: %d request(s) finished with an error", failed)
            if not await self.wait_idle(FLUSH_S):
                logger.warning("%d response(s) still open after the grace period",
                               self.in_flight)
        logger.info("drained in %.2f s", time.monotonic() - start)


class LifecycleMiddleware:
    """Counts in-flight HTTP requests; answers 503 while draining."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lifecycle = self.lifecycle
        if lifecycle.draining and scope.get("path") not in _ALWAYS_OPEN:
            error = shutting_down("not accepting new requests", lifecycle.retry_after)
            await error.response()(scope, receive, send)
            return
        lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.leave()


async def watch_engine(engine: Any, lifecycle: Lifecycle, drain_s: float,
                       on_exit: Callable[[], None]) -> None:
    """Wait for the engine core to die; then drain briefly and call ``on_exit``."""
    while not engine.is_dead:
        await asyncio.sleep(ENGINE_POLL_S)
    logger.error("engine core is dead (%s); exiting with status 1 after a %.1f s drain "
                 "(--keep_serving_on_engine_death keeps answering 503 instead)",
                 engine.dead_reason, drain_s)
    # Pending requests were already failed with EngineDeadError and new ones get 503
    # engine_dead from the handlers; let those responses go out.
    await lifecycle.wait_idle(drain_s)
    on_exit()
