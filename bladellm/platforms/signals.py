"""Holding the stop signals while a child process starts (the engine core, worker ranks), and
telling an interrupted start-up from a failed one."""

from __future__ import annotations

import contextlib
import signal
from multiprocessing import resource_tracker
import threading
from collections.abc import Iterator


STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked, then delivered) until the block ends. Around starting
    a child process: a signal that interrupts ``Process.start()`` half-way leaves the child
    reading a truncated start-up message, and it dies with an ``EOFError`` traceback.

    The child inherits the block (fork and exec keep the signal mask): its entry point must
    unblock them first thing (``unblock_stop_signals``). Python's resource tracker is started
    before the block: started by the first ``Process.start()`` instead, it blocks and then
    *unblocks* these signals, cancelling our block half-way. Only the main thread can block
    them meaningfully: from another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    """First thing in a child started under ``stop_signals_held``: take the inherited block
    off (a signal that came meanwhile is delivered now, to the handlers set before this)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

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
