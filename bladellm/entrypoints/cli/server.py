"""``blade_llm_server``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any

from bladellm.entrypoints.cli.args import parse_args
from bladellm.platforms.signals import caused_by_interrupt


def _is_local(model: str) -> bool:
    """'demo' or a path that exists: nothing to fetch before the engine core can load it."""
    return model == "demo" or os.path.exists(os.path.expanduser(model))


def _interrupt(signum: int, _frame: Any) -> None:
    """The start-up SIGINT/SIGTERM handler (an import can wrap its ``KeyboardInterrupt`` in
    another exception: ``RuntimeError`` from a dataclass's ``__set_name__``, say)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    # SIGINT/SIGTERM from the first moment: during start-up (imports, model load) they stop the
    # server cleanly (the engine core started below is closed, no traceback); once serving,
    # run_server's handlers drain requests first. The caller's handlers come back when we
    # return (an in-process caller must not keep SIGTERM raising KeyboardInterrupt).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    engine_config, server_config = parse_args(argv)
    # Start the engine-core process before importing the HTTP stack and the tokenizer: its own
    # imports and model load run beside ours (a few seconds of a cold start on 2 cores). A hub
    # model id is fetched by the API process first, which then starts the core itself.
    client = None
    if _is_local(engine_config.model.model):
        from bladellm.engine.core_client import AsyncMPClient

        client = AsyncMPClient(engine_config, wait=False, log_level=server_config.py_log_level)
    try:
        from bladellm.entrypoints.api_server import run_server

        return run_server(engine_config, server_config, client=client)
    except BaseException:  # (closing an already closed client does nothing)
        if client is not None:
            client.close()
        raise


def cli() -> None:
    """The ``blade_llm_server`` command. When the server has shut down (engine core joined,
    sockets closed, logs written), the process ends without interpreter finalization: tearing
    down torch, the tokenizer and the HTTP stack would spend the shutdown budget (grace + 2 s)
    that orchestrators wait for on nothing."""
    try:
        code = main()
    except BaseException as exc:
        if not caused_by_interrupt(exc):  # a real failure keeps its traceback and status
            raise
        # SIGINT/SIGTERM during start-up: nothing was serving yet. Import nothing more: the
        # signal may have cut an import half-way (numpy's, say), and importing it again fails.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(0)
    from bladellm.engine.core_proc import exit_process_now

    exit_process_now(code)


if __name__ == "__main__":
    cli()
