"""The process boundary: an engine core in its own process, driven over ZMQ with msgpack.

API process                                   engine-core process
  AsyncMPClient.input  (PUSH, bind) ──────►  (PULL, connect)  ADD / ABORT / UTILITY / SHUTDOWN
  AsyncMPClient.output (PULL, bind) ◄──────  (PUSH, connect)  EngineCoreOutputs

The core runs a busy loop while it has work and blocks on its input socket when idle. If it
raises, it sends ``engine_dead`` before exiting; if it is killed, the client notices the process is
gone within ``_DEAD_POLL_MS``. Either way every pending request fails with ``EngineDeadError``.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from bladellm.config import EngineConfig
from bladellm.engine.errors import EngineDeadError
from bladellm.engine.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

_DEAD_POLL_MS = 500
_READY_TIMEOUT_S = 1800.0


class Msg(bytes, enum.Enum):
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"
    SHUTDOWN = b"S"


# ---- engine-core process side -------------------------------------------------------------------

def run_engine_core_proc(config: EngineConfig, input_addr: str, output_addr: str,
                         ready_conn: Any, log_level: int) -> None:
    """Entry point of the engine-core process."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(message)s")
    # The parent handles Ctrl-C and tells us to shut down; we must not die half-way on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        from bladellm.engine.engine_core import EngineCore
        from bladellm.model.checkpoint import resolve_model
        core = EngineCore(config, resolve_model(config.model))
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure to the parent
        ready_conn.send({"status": "failed",
                         "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
        return
    ready_conn.send({"status": "ready", "num_blocks": core.num_blocks})
    ready_conn.close()

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    out.setsockopt(zmq.LINGER, 2000)
    try:
        _busy_loop(core, inp, out, parent)
    except BaseException:  # noqa: BLE001
        reason = traceback.format_exc()
        logger.error("engine core died:\n%s", reason)
        out.send(msgspec.msgpack.encode(EngineCoreOutputs(engine_dead=reason, timestamp=time.time())))
        raise
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def _busy_loop(core: Any, inp: zmq.Socket, out: zmq.Socket, parent_pid: int) -> None:
    req_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    encoder = msgspec.msgpack.Encoder()
    while True:
        idle = not core.has_unfinished_requests()
        # Block while idle (waking up now and then to notice an orphaned process).
        if not inp.poll(_DEAD_POLL_MS if idle else 0):
            if idle and os.getppid() != parent_pid:
                return
            if idle:
                continue
        extra = []
        while inp.poll(0):
            kind, payload = inp.recv_multipart()
            if kind == Msg.ADD:
                core.add_request(req_decoder.decode(payload))
            elif kind == Msg.ABORT:
                extra.extend(core.abort_requests(msgspec.msgpack.decode(payload)))
            elif kind == Msg.UTILITY:
                call_id, method, args = msgspec.msgpack.decode(payload)
                result = _utility(core, method, args)
                out.send(encoder.encode(EngineCoreOutputs(utility_result=(call_id, result))))
            elif kind == Msg.SHUTDOWN:
                return
        if core.has_unfinished_requests():
            outputs = core.step()
            if extra:
                outputs.outputs = extra + outputs.outputs
            out.send(encoder.encode(outputs))
        elif extra:
            out.send(encoder.encode(EngineCoreOutputs(
                outputs=extra, scheduler_stats=core.scheduler.get_stats(), timestamp=time.time())))


def _utility(core: Any, method: str, args: list) -> Any:
    if method == "check_invariants":
        core.scheduler.check_invariants()
        return True
    if method == "get_stats":
        return msgspec.to_builtins(core.scheduler.get_stats())
    if method == "raise":  # test hook: prove that a dead core fails requests instead of hanging
        raise RuntimeError(f"raise requested: {args}")
    raise ValueError(f"unknown utility {method!r}")


# ---- API process side ---------------------------------------------------------------------------

class AsyncMPClient:
    """Starts the engine-core process and talks to it from an asyncio event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="bladellm-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._encoder = msgspec.msgpack.Encoder()
        self.dead_reason: str | None = None
        self._next_call = 0

        mp = multiprocessing.get_context("spawn")
        reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core_proc, name="bladellm-engine-core", daemon=True,
            args=(config, input_addr, output_addr, writer, logging.getLogger().level or 20))
        self.proc.start()
        writer.close()
        self.num_blocks = self._wait_ready(reader)

    def _wait_ready(self, reader: Any) -> int:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if reader.poll(1.0):
                try:
                    msg = reader.recv()
                except EOFError:
                    break
                if msg["status"] == "ready":
                    return msg["num_blocks"]
                self.close()
                raise RuntimeError(f"engine core failed to start: {msg['error']}")
            if not self.proc.is_alive():
                break
        self.close()
        raise RuntimeError(f"engine core exited during start-up (exit code {self.proc.exitcode})")

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def _check_alive(self) -> None:
        if self.dead_reason is None and not self.proc.is_alive():
            self.dead_reason = f"engine core process exited (exit code {self.proc.exitcode})"
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        for req in requests:
            await self._input.send_multipart((Msg.ADD.value, self._encoder.encode(req)))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            await self._input.send_multipart((Msg.ABORT.value, self._encoder.encode(request_ids)))

    async def call_utility(self, method: str, *args: Any) -> int:
        """Send a utility call; its result arrives in EngineCoreOutputs.utility_result."""
        self._check_alive()
        self._next_call += 1
        payload = self._encoder.encode((self._next_call, method, list(args)))
        await self._input.send_multipart((Msg.UTILITY.value, payload))
        return self._next_call

    async def get_output(self) -> EngineCoreOutputs:
        """Next batch of outputs; raises EngineDeadError once the core is gone."""
        while True:
            self._check_alive()
            if await self._output.poll(_DEAD_POLL_MS):
                outputs = self._decoder.decode(await self._output.recv())
                if outputs.engine_dead is not None:
                    self.dead_reason = outputs.engine_dead
                return outputs

    def close(self) -> None:
        if self.proc.is_alive():
            # A synchronous view of the same socket: close() may run outside any event loop.
            sync_input = zmq.Socket.shadow(self._input.underlying)
            try:
                sync_input.send_multipart((Msg.SHUTDOWN.value, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        if self.dead_reason is None:
            self.dead_reason = "engine shut down"
        # destroy(linger=0): unsent messages to a dead core must not block shutdown.
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
