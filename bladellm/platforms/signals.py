"""Holding the stop signals while a child process starts (the engine core, worker ranks), and
telling an interrupted start-up from a failed one."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked, then delivered) until the block ends. Around starting
    a child process: a signal that interrupts ``Process.start()`` half-way leaves the child
    reading a truncated start-up message, and it dies with an ``EOFError`` traceback. (The
    child does not inherit the block.) Only the main thread can block them meaningfully: from
    another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def caused_by_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` or comes from one that code on the way wrapped
    in another exception (a dataclass's ``__set_name__`` does): its ``__cause__`` /
    ``__context__`` chain holds one."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
