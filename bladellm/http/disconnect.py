"""Awaiting work for an HTTP request while watching for its client to leave: shared by the
server's handlers (the work is engine requests, aborted when cancelled) and the router (the work
is the upstream request, whose connection closing makes the instance abort)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(awaitable: Awaitable[T], request: Request,
                           gone: Callable[[], BaseException],
                           discard: Callable[[Any], Awaitable[None]] | None = None) -> T:
    """Await ``awaitable`` unless the client disconnects first; then cancel it and raise
    ``gone()``. With ``discard``, a result that was ready just as the client left is handed to
    it (to release what it holds) and ``gone()`` raised; without, that result is returned."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller itself was cancelled (e.g. a shutdown timeout)
        work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        raise
    left = watcher.done()
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    if work.done() and not (left and discard is not None):
        return work.result()
    work.cancel()
    late = (await asyncio.gather(work, return_exceptions=True))[0]
    if discard is not None and not isinstance(late, BaseException):
        await discard(late)
    raise gone()
