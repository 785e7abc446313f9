"""The engine-core process: its entry point and busy loop (the API process starts it through
``core_client.AsyncMPClient``).

It builds the ``EngineCore`` (which builds the executor and its workers), reports ready, then loops:
drain the input socket (ADD / ABORT / UTILITY / SHUTDOWN), step while there is work, send
``EngineCoreOutputs``; it blocks on the input socket when idle. If it raises, it sends
``engine_dead`` before exiting. If the API process is gone (killed, even by SIGKILL), it stops
within ``DEAD_POLL_MS``, whether idle or in the middle of requests, and frees what it holds.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from bladellm.config import EngineConfig
from bladellm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from bladellm.platforms.heap import freeze_startup_heap
from bladellm.platforms.signals import unblock_stop_signals

# The API process imports this module to start the core (core_client), before it imports
# anything heavy: nothing here may import torch at module level (the executor, the model), or
# the core would start only after the API process spent seconds importing torch for nothing
# (tests/unit/checkpoint/test_resolution_cache.py checks).

logger = logging.getLogger(__name__)

# How often each side checks that the other process is alive while it waits (ms).
DEAD_POLL_MS = 500
# How long a core told to SHUTDOWN may take to finish the step it is in before it is killed (s).
# An idle core stops in milliseconds and a decode step fits well within this; a large prefill
# step on a loaded machine can take seconds, all of them past the server's grace period and
# computing results no one will read. Killed or not, the kernel then needs time to tear the
# process down, inside the same grace + 2 s budget (docs/cpu.md).
SHUTDOWN_WAIT_S = 0.5
# How often the engine core checks, while it starts, that the API process is still there (s).
_START_WATCH_S = 0.1


class Msg(bytes, enum.Enum):
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    SHUTDOWN = b"S"


def tell_parent(conn: Any, message: dict) -> bool:
    """Send a start-up message; False (quietly) when the API process is gone: stopped by a
    signal during start-up, it closed its end, and a traceback here would only be noise."""
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        return False


def run_engine_core_proc(config: EngineConfig, input_addr: str, output_addr: str,
                         ready_conn: Any, log_level: int) -> None:
    """Entry point of the engine-core process."""
    # The parent handles Ctrl-C and tells us to shut down; we must not die half-way on SIGINT.
    # Set before the inherited block (stop_signals_held) comes off: a Ctrl-C that came while
    # this process started is dropped, a SIGTERM ends it (start-up is not protected).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock_stop_signals()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(message)s")
    parent = os.getppid()
    started = threading.Event()
    threading.Thread(target=_end_if_orphaned_during_start, args=(parent, started),
                     name="bladellm-core-start-watch", daemon=True).start()
    try:
        from bladellm.engine.engine_core import EngineCore
        from bladellm.model.loader import resolve_model

        core = EngineCore(config, resolve_model(config.model, snapshot_config=True,
                                                   device=config.device))
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure to the parent
        error = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ValueError):  # ValueError: a flag or the checkpoint's config,
            error += f"\n{traceback.format_exc()}"  # its message says all (no traceback)
        else:  # still there for --log_level debug, should a library raise one by mistake
            logger.debug("engine core start-up failed", exc_info=True)
        tell_parent(ready_conn, {"status": "failed", "error": error})
        return
    if not tell_parent(ready_conn, {"status": "ready", "num_blocks": core.num_blocks}):
        core.shutdown()
        return
    try:
        # The front end answers with the model's EOS ids (it loads the tokenizer; we don't).
        setup = ready_conn.recv()
    except EOFError:  # the API process gave up on us (or died) during its own start-up
        core.shutdown()
        return
    ready_conn.close()
    # From here on the parent owns our life: a SIGTERM sent to the whole process group (systemd's
    # control-group stop, `kill -- -PGID`) must not kill us while the API process gives running
    # requests their grace period; the parent then sends SHUTDOWN, or SIGKILL when a step is
    # still running (core_client.AsyncMPClient.close). An orphan is noticed by the loop now.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started.set()
    core.set_eos_token_ids(setup["eos_token_ids"])

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    out.setsockopt(zmq.LINGER, 2000)
    # A PUSH socket whose peer is gone blocks in send forever: wait at most this long, then
    # look whether the API process is still there (_send).
    out.setsockopt(zmq.SNDTIMEO, DEAD_POLL_MS)
    freeze_startup_heap()
    try:
        _busy_loop(core, inp, out, parent)
    except _Orphaned:
        logger.warning("the API process is gone: stopping the engine core")
    except BaseException:  # noqa: BLE001
        reason = traceback.format_exc()
        logger.error("engine core died:\n%s", reason)
        try:
            _send(out, msgspec.msgpack.encode(
                EngineCoreOutputs(engine_dead=reason, timestamp=time.time())), parent)
        except _Orphaned:
            pass
        raise
    finally:
        core.shutdown()  # worker processes (world size > 1) end with us, never orphaned
        inp.close(linger=0)
        out.close()
        ctx.term()
        # The final collection of the model's heap at interpreter exit takes seconds and
        # serves no one: skip it (see entrypoints/cli/server.py).
        gc.freeze()
    # A clean stop. Interpreter finalization of a process holding torch and the model (module
    # teardown, thread pools) would spend the server's shutdown budget (grace + 2 s) on
    # nothing: nothing is left to flush but the logs.
    exit_process_now(0)


def _end_if_orphaned_during_start(parent_pid: int, started: threading.Event) -> None:
    """Start-up (model load, KV sizing) can take minutes and reads nothing from the parent: if
    the API process dies meanwhile (a signal before its handlers were installed, SIGKILL), stop
    at once rather than finish loading for no one: the process ends here, whatever the main
    thread is doing (no signal, which a mask could hold); worker processes die with it
    (PR_SET_PDEATHSIG)."""
    while not started.wait(_START_WATCH_S):
        if os.getppid() != parent_pid:
            logger.warning("the API process is gone during start-up: stopping the engine core")
            exit_process_now(1)


def exit_process_now(code: int) -> None:
    """Flush logs and stdio, then end the process without interpreter finalization. Only for
    a process's own entry point, once everything it owns is closed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to say there
            pass
    os._exit(code)


class _Orphaned(Exception):
    """The process that started the engine core is gone: no one will read its outputs."""


def _send(out: zmq.Socket, data: bytes, parent_pid: int) -> None:
    """Send ``data``, waiting as long as the API process lives (``out`` has a send timeout)."""
    while True:
        try:
            out.send(data)
            return
        except zmq.Again:
            if os.getppid() != parent_pid:
                raise _Orphaned from None


def _busy_loop(core: Any, inp: zmq.Socket, out: zmq.Socket, parent_pid: int) -> None:
    req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    encoder = msgspec.msgpack.Encoder()
    while True:
        idle = not core.has_unfinished_requests()
        # Block while idle, waking up now and then to notice an orphaned process. While busy,
        # look every step: ZMQ queues a dead peer's outputs (up to its high-water mark, 1000
        # steps) before a send blocks.
        if not idle and os.getppid() != parent_pid:
            raise _Orphaned
        if not inp.poll(DEAD_POLL_MS if idle else 0):
            if idle and os.getppid() != parent_pid:
                raise _Orphaned
            if idle:
                core.executor.check_health()  # a worker that died while idle: report dead now
                continue
        extra = []
        start = time.perf_counter()
        while inp.poll(0):
            kind, payload = inp.recv_multipart()
            if kind == Msg.ADD:
                core.add_request(req_decoder.decode(payload))
            elif kind == Msg.ABORT:
                extra.extend(core.abort_requests(msgspec.msgpack.decode(payload)))
            elif kind == Msg.UTILITY:
                call_id, method, args = msgspec.msgpack.decode(payload)
                result = _utility(core, method, args)
                _send(out, encoder.encode(EngineCoreOutputs(utility_result=(call_id, result))),
                      parent_pid)
            elif kind == Msg.SHUTDOWN:
                return
        core.phases.since("recv", start)
        if core.has_unfinished_requests():
            outputs = core.step()
            if extra:
                outputs.outputs = extra + outputs.outputs
            start = time.perf_counter()
            _send(out, encoder.encode(outputs), parent_pid)
            core.phases.since("send", start)  # reported with the next step's stats
        elif extra:
            _send(out, encoder.encode(EngineCoreOutputs(
                outputs=extra, scheduler_stats=core.scheduler.get_stats(), timestamp=time.time())),
                parent_pid)


def _utility(core: Any, method: str, args: list) -> Any:
    if method == "check_invariants":
        core.scheduler.check_invariants()
        return True
    if method == "get_stats":
        return msgspec.to_builtins(core.scheduler.get_stats())
    if method == "guided_stats":  # compiled-grammar cache counters (tests, debugging)
        return core.guided.stats()
    if method == "remove_lora":
        core.remove_lora(int(args[0]))
        return True
    if method == "embed":  # one extra forward per prompt, between steps
        from bladellm.executor import WorkerDiedError

        try:
            return {"result": getattr(core, method)(*args)}
        except WorkerDiedError:
            raise  # no worker left to serve anything: the engine is dead
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the engine
            logger.error("%s failed: %s", method, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
    if method == "raise":  # test hook: prove that a dead core fails requests instead of hanging
        raise RuntimeError(f"raise requested: {args}")
    raise ValueError(f"unknown utility {method!r}")
