"""The API process's side of the process boundary: starts the engine-core process
(``core_proc.py``) and drives it over ZMQ with msgpack.

API process                                   engine-core process
  AsyncMPClient.input  (PUSH, bind) ──────►  (PULL, connect)  ADD / ABORT / UTILITY / SHUTDOWN
  AsyncMPClient.output (PULL, bind) ◄──────  (PUSH, connect)  EngineCoreOutputs

The core runs a busy loop while it has work and blocks on its input socket when idle. If it
raises, it sends ``engine_dead`` before exiting; if it is killed, the client notices the process is
gone within ``DEAD_POLL_MS``. Either way every pending request fails with ``EngineDeadError``.
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from bladellm.config import EngineConfig
from bladellm.engine.core_proc import DEAD_POLL_MS, SHUTDOWN_WAIT_S, Msg, run_engine_core_proc
from bladellm.errors import EngineDeadError
from bladellm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from bladellm.platforms.threads import engine_process_env, process_env
from bladellm.platforms.signals import stop_signals_held

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 1800.0


class AsyncMPClient:
    """Starts the engine-core process and talks to it from an asyncio event loop."""

    def __init__(self, config: EngineConfig, wait: bool = True,
                 log_level: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        """Start the engine-core process; with ``wait=False`` return at once and let the caller
        do its own start-up work while the core loads the model (the caller loads the
        tokenizer, which knows the model's EOS ids), then call ``wait_ready(eos_token_ids)``."""
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
        # Start-up handshake: the core says ready, we answer with the model's EOS ids.
        reader, writer = mp.Pipe()
        self.proc = mp.Process(
            target=run_engine_core_proc, name="bladellm-engine-core", daemon=True,
            args=(config, input_addr, output_addr, writer,
                  log_level or logging.getLogger().level or logging.INFO))
        # OpenMP reads the environment when the child starts; a signal must not cut the start.
        with process_env(engine_process_env()), stop_signals_held():
            self.proc.start()
        writer.close()
        self._ready_reader = reader
        self.num_blocks = 0
        self._ready = False
        if wait:
            self.wait_ready(eos_token_ids)

    def wait_ready(self, eos_token_ids: Sequence[int]) -> None:
        """Block until the engine core has loaded the model and sized its KV cache, then hand it
        the model's EOS ids (``ModelInfo.eos_token_ids``), before any request."""
        self.num_blocks = self._wait_ready(self._ready_reader)
        try:
            self._ready_reader.send({"eos_token_ids": [int(t) for t in eos_token_ids]})
        except OSError:  # the core died right after saying ready: requests will see it dead
            pass
        self._ready_reader.close()
        self._ready = True

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
            if await self._output.poll(DEAD_POLL_MS):
                outputs = self._decoder.decode(await self._output.recv())
                if outputs.engine_dead is not None:
                    self.dead_reason = outputs.engine_dead
                return outputs

    def close(self) -> None:
        if self.proc.is_alive() and not self._ready:
            self.proc.terminate()  # still loading: it reads no messages yet
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            # A synchronous view of the same socket: close() may run outside any event loop.
            sync_input = zmq.Socket.shadow(self._input.underlying)
            try:
                sync_input.send_multipart((Msg.SHUTDOWN.value, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout=SHUTDOWN_WAIT_S)
            if self.proc.is_alive():  # still in a step (it ignores SIGTERM once ready)
                self.proc.kill()
                self.proc.join()
        if self.dead_reason is None:
            self.dead_reason = "engine shut down"
        # destroy(linger=0): unsent messages to a dead core must not block shutdown.
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
