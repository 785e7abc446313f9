"""A worker rank's side of the executor channel (``multiproc.py`` is the engine core's side).

Every message is ``MessageCodec``-signed (``channel.py``). Engine → ranks (PUB/SUB):
``(call_id, method, args)``; ranks → engine (PUSH/PULL): ``(call_id, rank, ok, value)``.
Call ids >= 0 are calls, run in the order published (an id not above the last one run is
dropped: a replayed message cannot run a step twice); the negative ids below are control
messages.

A rank on the engine's machine is spawned by the executor and dies with it (``PR_SET_PDEATHSIG``
and a parent check). A rank on another machine (``blade_llm_worker``) cannot be watched that
way, so both sides send heartbeats: the rank first joins (its settings are compared with the
engine's, a mismatch is refused), then a thread sends one every ``HEARTBEAT_S`` and ends the
process when the engine (which publishes heartbeats too) has been silent for
``ENGINE_SILENCE_S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from bladellm.config import EngineConfig
from bladellm.executor.channel import BadMessageError, MessageCodec, make_curve_client
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.platforms.signals import unblock_stop_signals

logger = logging.getLogger(__name__)

# Control call ids (both directions).
START = -1  # rank -> engine: started (ok) or its start-up error
SHUTDOWN = -2  # engine -> ranks: leave; rank -> engine: leaving
HEARTBEAT = -3
JOIN = -4  # rank -> engine: (settings); engine -> ranks: (rank, pid, error or None)

HEARTBEAT_S = 1.0
ENGINE_SILENCE_S = 15.0  # a remote rank leaves after this long without a message
JOIN_TIMEOUT_S = 600.0  # a remote rank started before the engine waits this long for it
_PR_SET_PDEATHSIG = 1

# Settings that may differ between nodes: where this node is, how it reaches node 0, its key
# file's path (a wrong key fails the MAC anyway) and its own thread count.
_PER_NODE = ("parallel.node_rank", "parallel.master_addr", "parallel.cluster_key_file",
             "parallel.num_threads")


@dataclass(frozen=True)
class WorkerSpec:
    """Where a rank is and how it reaches the engine core (picklable: spawn arguments)."""

    rank: int
    local_world_size: int  # ranks on this machine (they share its cores and memory)
    init_method: str  # torch.distributed rendezvous
    bcast_addr: str
    result_addr: str
    key: bytes
    curve: bool  # the engine's sockets are CURVE servers (multi-node)
    remote: bool  # on another node: join, heartbeats, leave when the engine goes silent
    log_level: int = logging.INFO


def node_settings(config: EngineConfig, resolved: ResolvedModel) -> dict[str, Any]:
    """What every node must agree on: the engine config (less ``_PER_NODE``) and the model's
    own config, dtype and length. Compared at join, so a node started with other flags or
    another checkpoint is refused instead of computing garbage."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}{f.name}.", value)
            elif f"{prefix}{f.name}" not in _PER_NODE:
                flat[f"{prefix}{f.name}"] = repr(value)

    walk("", config)
    hf = resolved.hf_config
    text = hf.to_json_string() if hasattr(hf, "to_json_string") else json.dumps(
        vars(hf), sort_keys=True, default=repr)
    flat["model.config_json_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    flat["model.resolved_dtype"] = str(resolved.dtype)
    flat["model.resolved_max_model_len"] = str(resolved.max_model_len)
    import bladellm

    flat["bladellm.version"] = bladellm.__version__
    return flat


def settings_diff(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [f"{k}: {ours.get(k, '<unset>')} on the engine, {theirs.get(k, '<unset>')} here"
            for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (even by SIGKILL); elsewhere the
    parent-pid check in the loop is the fallback."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Link:
    """The rank's two sockets (SUB for calls, PUSH for answers) and its codec."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.codec = MessageCodec(spec.key)
        self.ctx = zmq.Context()
        self.sub = self._socket(zmq.SUB, spec.bcast_addr)
        self.push = self._socket(zmq.PUSH, spec.result_addr)
        self.last_heard = time.monotonic()
        self.last_call = -1

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 0)  # never drop a step
        else:
            sock.setsockopt(zmq.LINGER, 1000)
        if self.spec.curve:
            make_curve_client(sock, self.spec.key)
        sock.connect(addr)
        return sock

    def send(self, call_id: int, ok: bool, value: Any) -> None:
        self.push.send(self.codec.pack((call_id, self.spec.rank, ok, value)))

    def recv(self, timeout_ms: int) -> tuple[int, str, tuple[Any, ...]] | None:
        """The next authentic message, or None after ``timeout_ms`` without one."""
        if not self.sub.poll(timeout_ms):
            return None
        data = self.sub.recv()
        try:
            msg = self.codec.unpack(data)
        except BadMessageError as exc:
            logger.warning("rank %d: dropped a message: %s", self.spec.rank, exc)
            return None
        self.last_heard = time.monotonic()
        return msg

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self) -> None:
        self.sub.close(linger=0)
        self.push.close()
        self.ctx.term()


def _join(link: _Link, settings: dict[str, Any]) -> None:
    """Announce this rank until the engine answers (a SUB socket misses what was published
    before it connected, so the request repeats); raises if refused or nobody answers."""
    rank, pid = link.spec.rank, os.getpid()
    info = {"settings": settings, "host": socket.gethostname(), "pid": pid}
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    heard = False
    next_log = time.monotonic() + 10
    while True:
        link.send(JOIN, True, info)
        end = time.monotonic() + 1.0
        while (left := end - time.monotonic()) > 0:
            msg = link.recv(int(left * 1000) + 1)
            if msg is None:
                continue
            heard = True
            call_id, _, args = msg
            if call_id == JOIN and args[:2] == (rank, pid):
                if args[2] is not None:
                    raise RuntimeError(f"the engine refused rank {rank}: {args[2]}")
                return
            if call_id == SHUTDOWN:
                raise RuntimeError(f"the engine shut down before rank {rank} joined")
        now = time.monotonic()
        if heard and link.silent_for() > ENGINE_SILENCE_S:
            raise RuntimeError(f"the engine at {link.spec.bcast_addr} went silent")
        if now > deadline:
            raise RuntimeError(f"no engine answered at {link.spec.bcast_addr} within "
                               f"{JOIN_TIMEOUT_S:.0f} s (not started, unreachable, or another "
                               f"--cluster_key_file)")
        if now > next_log:
            logger.info("waiting for the engine at %s", link.spec.bcast_addr)
            next_log = now + 10


def _heartbeats(spec: WorkerSpec, ctx: zmq.Context, stop: threading.Event) -> None:
    """A remote rank's watchdog thread (own sockets: zmq sockets are not thread-safe). It tells
    the engine this rank lives, also while the main thread loads the model or runs a long step,
    and ends the process when the engine has been silent for ``ENGINE_SILENCE_S``: the main
    thread may be blocked in a collective whose peers are gone, where no loop of its own runs."""
    codec = MessageCodec(spec.key)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 4)  # nobody reading: drop beats, do not queue them
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for sock, addr in ((push, spec.result_addr), (sub, spec.bcast_addr)):
        if spec.curve:
            make_curve_client(sock, spec.key)
        sock.connect(addr)
    beat = codec.pack((HEARTBEAT, spec.rank, True, None))
    heard = next_beat = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_beat:
            with contextlib.suppress(zmq.Again):
                push.send(beat, flags=zmq.NOBLOCK)
            next_beat = now + HEARTBEAT_S
        if sub.poll(200) and codec.verify(sub.recv()):  # verified, never unpickled here
            heard = time.monotonic()
        if time.monotonic() - heard > ENGINE_SILENCE_S:
            logger.error("rank %d: nothing from the engine for %.0f s; leaving", spec.rank,
                         ENGINE_SILENCE_S)
            logging.shutdown()
            os._exit(1)  # the main thread may be stuck in a collective: no clean way out
    push.close()
    sub.close(linger=0)


def _rank_threads(config: EngineConfig, local_world_size: int) -> int:
    """Torch threads per rank: ``--num_threads`` is the engine's total on this machine, shared
    by its ranks (default: one per usable CPU), so ranks never oversubscribe the cores."""
    from bladellm import envs
    from bladellm.platforms.cpu import detect_cpu

    total = (config.parallel.num_threads or envs.omp_num_threads()
             or detect_cpu().num_cpus)
    return max(1, total // local_world_size)


def worker_main(config: EngineConfig, resolved: ResolvedModel, spec: WorkerSpec) -> int:
    """Entry point of a worker rank; returns the process exit status."""
    if not spec.remote:
        # The engine core decides when we stop (SHUTDOWN, or it dies and PR_SET_PDEATHSIG
        # kills us): a stop signal sent to the whole process group (Ctrl-C, systemd's
        # control-group SIGTERM) must not kill a rank while the API process drains requests.
        # Set before the inherited block (stop_signals_held) comes off: one that came while
        # this process started is dropped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    unblock_stop_signals()
    _die_with_parent()
    rank = spec.rank
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
    link = _Link(spec)
    stop_beats = threading.Event()
    beats = None
    try:
        if spec.remote:
            _join(link, node_settings(config, resolved))
            beats = threading.Thread(target=_heartbeats, args=(spec, link.ctx, stop_beats),
                                     name="bladellm-heartbeat", daemon=True)
            beats.start()
            logger.info("rank %d joined the engine at %s", rank, spec.bcast_addr)
        return _serve(config, resolved, link)
    except Exception as exc:  # noqa: BLE001 - a refused join: say why, exit non-zero
        logger.error("rank %d: %s", rank, exc)
        return 1
    finally:
        stop_beats.set()
        if beats is not None:
            beats.join()
        link.close()


def _serve(config: EngineConfig, resolved: ResolvedModel, link: _Link) -> int:
    spec = link.spec
    rank = spec.rank
    try:
        from bladellm.distributed.parallel_state import init_model_parallel
        from bladellm.platforms.select import resolve_platform
        from bladellm.worker.worker import Worker

        par = config.parallel
        # The same torch.distributed code on every platform; its backend (gloo, NCCL) and the
        # device its messages live on come from the platform.
        platform = resolve_platform(config.device)
        device = platform.device(rank % spec.local_world_size)
        platform.set_device(device)
        init_model_parallel(rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                            spec.init_method, backend=platform.dist_backend,
                            expert_parallel=par.enable_expert_parallel, device=str(device))
        worker = Worker(config, resolved, rank=rank,
                        num_threads=_rank_threads(config, spec.local_world_size),
                        local_world_size=spec.local_world_size)
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure
        logger.exception("rank %d failed to start", rank)  # the traceback stays in our log
        link.send(START, False, f"{type(exc).__name__}: {exc}")
        return 1
    link.send(START, True, None)
    code = _loop(worker, link, config.parallel.driver_rank)
    from bladellm.distributed.parallel_state import reset_model_parallel

    channel = getattr(getattr(worker.model_runner.model, "model", None), "channel", None)
    if channel is not None and code == 0:
        channel.wait()  # the last activations sent to the next stage
    reset_model_parallel()
    return code


def _loop(worker: Any, link: _Link, driver: int) -> int:
    rank = link.spec.rank
    parent = os.getppid()
    answered_ping = False
    while True:
        msg = link.recv(1000)
        if msg is None:
            if os.getppid() != parent:
                return 1  # orphaned (no PDEATHSIG on this platform)
            continue  # (a remote rank's engine going silent: the heartbeat thread's watch)
        call_id, method, args = msg
        if call_id == SHUTDOWN:
            link.send(SHUTDOWN, True, None)
            return 0
        if call_id < 0:
            continue  # heartbeats, other ranks' joins
        if call_id <= link.last_call:
            logger.warning("rank %d: dropped call %d (replayed or out of order)", rank, call_id)
            continue
        link.last_call = call_id
        if method == "_ping":  # start-up handshake: answered once per rank
            if not answered_ping:
                answered_ping = True
                link.send(call_id, True, None)
            continue
        try:
            value = getattr(worker, method)(*args)
            ok = True
        except Exception as exc:  # noqa: BLE001 - reported to the engine core
            # The message may reach a client (a failed step fails its requests with it): no
            # traceback or file paths in it; those go to this rank's log.
            logger.exception("rank %d: %s failed", rank, method)
            value, ok = f"{type(exc).__name__}: {exc}", False
        if method == "execute_model" and rank != driver and ok:
            value = None  # the driver samples; the others only confirm they ran
        link.send(call_id, ok, value)
