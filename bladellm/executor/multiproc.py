"""World size > 1: one worker process per rank, driven from the engine-core process.

Transport (pyzmq; every message signed, see ``channel.py``; the ranks' side is
``worker_proc.py``):

- one PUB socket: every call (``execute_model`` with its ``SchedulerOutput``, or a
  ``collective_rpc``) is pickled once and published once; every rank's SUB socket receives it;
- one PULL socket: every rank answers every call on its PUSH socket, ``(call_id, rank, ok,
  value)``; the driver (the rank that samples: TP rank 0 of the last pipeline stage) sends the
  step's result, the others ``None``. Answers from every rank are what lets a failure on any
  rank surface as an error instead of a hang.

Both sockets bind IPC endpoints in a private temporary directory for the ranks on this machine
and, with ``--nnodes > 1``, TCP endpoints on ``--master_addr`` (ports ``--master_port`` + 1 and
+ 2, CURVE-encrypted) for the ranks of the other nodes, which ``blade_llm_worker`` starts.

Every rank runs the calls in the order they were published. Under pipeline parallelism the
engine core publishes up to ``--pipeline_parallel_size`` steps before it waits for the oldest
(``execute_model_async``): the first stage starts the next micro-batch while later stages work
on earlier ones. Answers to calls not waited for yet are kept until they are.

Tensors never cross this channel: the model's collectives (all-reduce, all-gather) run between
the workers on ``torch.distributed`` (gloo on CPU), rendezvous at ``--distributed_init_method``
or a free local TCP port (multi-node: ``tcp://MASTER_ADDR:MASTER_PORT``).

Lifetime: local workers are spawned (not forked: the engine core may hold threads and OpenMP
state), ask the kernel to SIGKILL them when the engine-core process dies (``PR_SET_PDEATHSIG``),
and also exit if their parent changes. The executor notices a dead local rank while it waits for
answers (it polls the processes' liveness between short socket waits), a remote one by its
missing heartbeats (``REMOTE_SILENCE_S``), and raises ``WorkerDiedError``, which the engine
core treats as fatal: the engine reports dead, clients get errors, nothing hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import secrets
import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from bladellm.config import EngineConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.executor.base import Executor, WorkerDiedError
from bladellm.executor.channel import (BadMessageError, MessageCodec, make_curve_server,
                                       read_cluster_key, require_curve)
from bladellm.executor.worker_proc import (HEARTBEAT, HEARTBEAT_S, JOIN, SHUTDOWN, START,
                                           WorkerSpec, node_settings, settings_diff,
                                           worker_main)
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.model.parallel_fit import check_pipeline_parallel, check_tensor_parallel
from bladellm.platforms.threads import engine_process_env, process_env
from bladellm.platforms.signals import stop_signals_held

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting executor checks that every worker still lives
_OUT_OF_STEP_S = 30.0  # how long the other ranks may take once one rank's call failed
_READY_TIMEOUT_S = 600.0  # model load of the slowest rank (and, multi-node, the nodes' start)
REMOTE_SILENCE_S = 10.0  # a remote rank silent this long (no heartbeat, no answer) is dead


@dataclass
class ReadyBitmask:
    """A structured-output bitmask already computed (``guided.manager.StepBitmask``'s
    interface): the engine core resolves the background future before publishing the step,
    since a future cannot cross processes."""

    req_ids: list[str]
    bitmask: np.ndarray

    def result(self) -> np.ndarray:
        return self.bitmask

    def wait(self) -> None:
        """Already computed."""


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine core is one, so that it never outlives the
    API process) start the workers: multiprocessing refuses because a daemon's children could
    be orphaned when it is terminated. Ours cannot: they die with their parent
    (``worker_proc._die_with_parent``) and check it in their loop."""
    config = multiprocessing.current_process()._config  # noqa: SLF001 - see above
    was = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


class _Publisher:
    """The PUB socket, shared by the engine core's thread and the heartbeat thread (a lock:
    zmq sockets are not thread-safe)."""

    def __init__(self, sock: zmq.Socket, codec: MessageCodec) -> None:
        self.sock = sock
        self.codec = codec
        self.lock = threading.Lock()
        self.next_call = 0

    def call(self, method: str, args: tuple[Any, ...]) -> int:
        with self.lock:
            call_id = self.next_call
            self.next_call += 1
            self.sock.send(self.codec.pack((call_id, method, args)))
        return call_id

    def control(self, call_id: int, args: tuple[Any, ...] = ()) -> None:
        with self.lock:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send(self.codec.pack((call_id, "", args)), flags=zmq.NOBLOCK)


def _beat(pub: _Publisher, stop: threading.Event) -> None:
    """Remote ranks leave when the engine is silent: keep talking while idle."""
    while not stop.wait(HEARTBEAT_S):
        pub.control(HEARTBEAT)


@dataclass
class _RemoteRanks:
    """The ranks of the other nodes: who joined (host, pid) and when each was last heard."""

    ranks: range
    ranks_per_node: int
    settings: dict[str, Any]
    joined: dict[int, tuple[str, int]] = field(default_factory=dict)
    last_seen: dict[int, float] = field(default_factory=dict)

    def where(self, rank: int) -> str:
        host = self.joined.get(rank, ("?", 0))[0]
        return f"rank {rank} (node {rank // self.ranks_per_node}, host {host})"

    def join(self, rank: int, info: dict[str, Any]) -> tuple[str | None, bool]:
        """(refusal or None, whether the refusal must fail the engine start)."""
        if rank not in self.ranks:
            return (f"rank {rank} is not a remote rank (expected {self.ranks.start}.."
                    f"{self.ranks.stop - 1}: --node_rank or LOCAL_RANK wrong)", True)
        who = (str(info.get("host")), int(info.get("pid", 0)))
        if rank in self.joined and self.joined[rank] != who:
            return (f"rank {rank} already joined from host {self.joined[rank][0]} pid "
                    f"{self.joined[rank][1]}", False)
        diff = settings_diff(self.settings, info.get("settings", {}))
        if diff:
            return ("started with other settings than the engine (same flags and model on "
                    "every node): " + "; ".join(diff), True)
        self.joined[rank] = who
        self.last_seen[rank] = time.monotonic()
        return None, False

    def alive(self) -> set[int]:
        """Joined ranks heard from within ``REMOTE_SILENCE_S``."""
        now = time.monotonic()
        return {r for r, seen in self.last_seen.items() if now - seen <= REMOTE_SILENCE_S}

    def check(self, what: str) -> None:
        now = time.monotonic()
        for rank, seen in self.last_seen.items():
            if now - seen > REMOTE_SILENCE_S:
                raise WorkerDiedError(f"worker {self.where(rank)} sent nothing for "
                                      f"{now - seen:.0f} s during {what} (dead or unreachable)")


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        super().__init__(config, resolved)
        par = config.parallel
        if par.node_rank != 0:
            raise ValueError(f"--node_rank {par.node_rank}: the engine runs on node 0; start "
                             f"the ranks of node {par.node_rank} with blade_llm_worker")
        check_tensor_parallel(resolved.hf_config, par.tensor_parallel_size,
                              None if resolved.gguf is not None else resolved.path,
                              par.pipeline_parallel_size,
                              expert_parallel=par.enable_expert_parallel)
        check_pipeline_parallel(resolved.hf_config, par.pipeline_parallel_size)
        multinode = par.nnodes > 1
        # Local-only: a fresh secret (the sockets are in a private directory anyway; one code
        # path). Multi-node: the key every node holds.
        key = read_cluster_key(par.cluster_key_file) if multinode else secrets.token_bytes(32)
        if multinode:
            require_curve()
        self._codec = MessageCodec(key)
        self.world_size = par.world_size
        self.num_local = par.ranks_per_node
        self.driver_rank = par.driver_rank
        self.max_concurrent_batches = par.pipeline_parallel_size
        # Answers read while waiting for another call: call_id -> {rank: (ok, value)}.
        self._answers: dict[int, dict[int, tuple[bool, Any]]] = {}
        self._remote = _RemoteRanks(range(self.num_local, self.world_size), self.num_local,
                                    node_settings(config, resolved))
        self._refused: str | None = None
        self._started = False  # every rank joined and answered: later refusals are not fatal
        self._announced: set[int] = set()
        self._ipc_dir = tempfile.mkdtemp(prefix="bladellm-workers-")
        bcast_addr = f"ipc://{self._ipc_dir}/bcast"
        result_addr = f"ipc://{self._ipc_dir}/result"
        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._pull = self._ctx.socket(zmq.PULL)
        if multinode:
            for sock in (pub, self._pull):
                make_curve_server(sock, key)
        pub.bind(bcast_addr)
        self._pull.bind(result_addr)
        if multinode:
            host, port = par.master_addr, par.master_port
            try:
                pub.bind(f"tcp://{host}:{port + 1}")
                self._pull.bind(f"tcp://{host}:{port + 2}")
            except zmq.ZMQError as exc:
                self._ctx.destroy(linger=0)
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
                raise ValueError(f"--master_addr {host} --master_port {port}: cannot listen on "
                                 f"ports {port + 1} and {port + 2} there ({exc})") from None
        self._pub = _Publisher(pub, self._codec)
        self._last_ping = -1  # answers to calls up to this one are start-up pings
        self._dead: str | None = None
        init_method = (f"tcp://{par.master_addr}:{par.master_port}" if multinode else
                       par.distributed_init_method or f"tcp://127.0.0.1:{_free_tcp_port()}")
        mp = multiprocessing.get_context("spawn")
        log_level = logging.getLogger().level or logging.INFO
        self.procs: list[Any] = []
        self._stop_beats = threading.Event()
        beats = None
        if multinode:
            beats = threading.Thread(target=_beat, args=(self._pub, self._stop_beats),
                                     name="bladellm-heartbeat", daemon=True)
        # Runs once: at shutdown(), or when the executor is collected / the interpreter exits.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self.procs, self._pub, self._pull, self._codec,
            self._remote, self._stop_beats, beats, self._ctx, self._ipc_dir)
        try:
            with process_env(engine_process_env()), _children_allowed():
                for rank in range(self.num_local):
                    spec = WorkerSpec(rank, self.num_local, init_method, bcast_addr, result_addr,
                                      key, curve=multinode, remote=False, log_level=log_level)
                    proc = mp.Process(target=worker_main, name=f"bladellm-worker-{rank}",
                                      daemon=True, args=(config, resolved, spec))
                    with stop_signals_held():  # a signal must not cut the start
                        proc.start()
                    self.procs.append(proc)
            if beats is not None:
                beats.start()
                logger.info("waiting for ranks %d..%d of nodes 1..%d (blade_llm_worker) at "
                            "%s:%d-%d", self.num_local, self.world_size - 1, par.nnodes - 1,
                            par.master_addr, par.master_port + 1, par.master_port + 2)
            self._wait_started()
        except BaseException:
            self.shutdown()
            raise
        # Connected sockets outlive their IPC files: remove them now, so that an engine core
        # killed before shutdown() leaves nothing in the temporary directory.
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        logger.info("%d worker processes ready (tensor parallel %d, pipeline parallel %d, "
                    "%d node(s), rendezvous %s)", self.world_size, par.tensor_parallel_size,
                    par.pipeline_parallel_size, par.nnodes, init_method)

    # ---- receiving ------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> bool:
        """Handle one message from a rank if one comes within ``timeout_ms``."""
        if not self._pull.poll(timeout_ms):
            return False
        data = self._pull.recv()
        try:
            got_id, rank, ok, value = self._codec.unpack(data)
        except BadMessageError as exc:
            logger.warning("dropped a message on the worker channel: %s", exc)
            return True
        if rank in self._remote.joined:
            self._remote.last_seen[rank] = time.monotonic()
        if got_id == JOIN:
            self._on_join(rank, value)
        elif got_id == START or got_id > self._last_ping:
            # A call published earlier or later and not waited for yet: keep it.
            self._answers.setdefault(got_id, {})[rank] = (ok, value)
        return True  # (a heartbeat, or a late answer to a start-up ping)

    def _on_join(self, rank: int, info: Any) -> None:
        refusal, fatal = self._remote.join(rank, info if isinstance(info, dict) else {})
        self._pub.control(JOIN, (rank, info.get("pid") if isinstance(info, dict) else None,
                                 refusal))
        if refusal is None:
            if rank not in self._announced:  # a rank repeats its join until it is answered
                self._announced.add(rank)
                logger.info("worker %s joined", self._remote.where(rank))
        else:
            logger.error("refused worker rank %d from host %s: %s", rank,
                         info.get("host") if isinstance(info, dict) else "?", refusal)
            # Fatal only while the engine starts; later a stray process (a mistyped
            # --node_rank, a changed flag) is refused and logged, the running ranks go on.
            if fatal and self._refused is None and not self._started:
                self._refused = f"worker rank {rank}: {refusal}"

    def _check_alive(self, what: str) -> None:
        while self._receive(0):  # heartbeats queued while nobody read them
            pass
        if self._refused is not None:
            raise RuntimeError(self._refused)
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._dead = (f"worker rank {rank} (pid {proc.pid}) died during {what} "
                              f"(exit code {proc.exitcode})")
                raise WorkerDiedError(self._dead)
        try:
            self._remote.check(what)
        except WorkerDiedError as exc:
            self._dead = str(exc)
            raise

    # ---- start-up -------------------------------------------------------------------------------
    def _wait_started(self) -> None:
        self._gather(START, timeout_s=_READY_TIMEOUT_S, what="start-up")
        # A SUB socket receives only what is published after its subscription reached us: ping
        # until every rank has answered one, so that no step can be lost to a slow joiner.
        pending = set(range(self.world_size))
        pings: list[int] = []
        deadline = time.monotonic() + 60
        while pending:
            pings.append(self._pub.call("_ping", ()))
            self._receive(50)
            for ping in pings:
                pending -= set(self._answers.get(ping, ()))
            self._check_alive("start-up")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"worker ranks {sorted(pending)} did not answer")
        self._last_ping = pings[-1]
        for ping in pings:
            self._answers.pop(ping, None)
        self._started = True

    # ---- calls ----------------------------------------------------------------------------------
    def _gather(self, call_id: int, timeout_s: float | None = None,
                what: str = "a step") -> list[Any]:
        """Every rank's answer to ``call_id`` in rank order; raises on a failed or dead rank."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out_of_step_at = None  # set once a rank failed while others are still busy
        next_check = time.monotonic() + _POLL_MS / 1000
        while True:
            got = self._answers.get(call_id, {})
            pending = set(range(self.world_size)) - set(got)
            errors = {rank: value for rank, (ok, value) in got.items() if not ok}
            if not pending:
                break
            # Liveness and time-outs are checked on a clock, not only when the socket is
            # quiet: with many remote ranks, heartbeats alone may keep it busy.
            if self._receive(_POLL_MS) and time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + _POLL_MS / 1000
            if errors:
                first = min(errors)
                if call_id == START:  # report the cause now, not the exit of the failed rank
                    raise RuntimeError(f"worker rank {first} failed to start: {errors[first]}")
                # A rank that failed before a collective leaves the others blocked in it: give
                # them a moment (a failure after the collectives lets them finish), then the
                # ranks are out of step for good and the engine cannot go on.
                now = time.monotonic()
                if out_of_step_at is None:
                    out_of_step_at = now + _OUT_OF_STEP_S
                elif now > out_of_step_at:
                    self._dead = (f"worker rank {first} failed during {what} ({errors[first]}) "
                                  f"while ranks {sorted(pending)} did not finish it")
                    raise WorkerDiedError(self._dead)
            self._check_alive(what)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerDiedError(f"worker ranks {sorted(pending)} did not answer within "
                                      f"{timeout_s:.0f} s during {what}")
        got = self._answers.pop(call_id)
        if errors:
            rank = min(errors)
            if call_id == START:
                raise RuntimeError(f"worker rank {rank} failed to start: {errors[rank]}")
            raise RuntimeError(f"worker rank {rank}: {errors[rank]}")
        return [got[rank][1] for rank in range(self.world_size)]

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        return self._gather(self._pub.call(method, args), what=method)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def execute_model_async(self, sched: SchedulerOutput) -> "PendingStep":
        """Publish the step now; its result is waited for by ``PendingStep.result()``."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        bitmask = sched.grammar_bitmask
        if bitmask is not None and not isinstance(bitmask, ReadyBitmask):
            # A failed fill raises here, inside the engine core's step guard: the step fails,
            # not the engine (the scheduler later waits on the original without raising).
            ready = ReadyBitmask(list(bitmask.req_ids), bitmask.result())
            sched = dataclasses.replace(sched, grammar_bitmask=ready)
        return PendingStep(self, self._pub.call("execute_model", (sched,)))

    def _step_result(self, call_id: int) -> ModelRunnerOutput:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        return self._gather(call_id, what="execute_model")[self.driver_rank]

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        self._check_alive("a health check")

    def shutdown(self) -> None:
        """Ask the workers to leave, then make sure they are gone (no orphans)."""
        self._finalizer()


@dataclass
class PendingStep:
    """A published step; ``result()`` waits for every rank's answer (once)."""

    executor: MultiprocExecutor
    call_id: int

    def result(self) -> ModelRunnerOutput:
        return self.executor._step_result(self.call_id)  # noqa: SLF001 - its own executor


def _stop_workers(procs: list[Any], pub: _Publisher, pull: zmq.Socket, codec: MessageCodec,
                  remote: _RemoteRanks, stop_beats: threading.Event,
                  beats: threading.Thread | None, ctx: zmq.Context, ipc_dir: str) -> None:
    """The executor's cleanup (a ``weakref.finalize`` callback: it must not hold the executor).
    Remote ranks cannot be killed from here: they confirm that they leave; one that does not
    leaves by itself once our heartbeats stop."""
    stop_beats.set()
    if beats is not None and beats.is_alive():
        beats.join()
    pub.control(SHUTDOWN)
    deadline = time.monotonic() + 5
    left: set[int] = set()

    def take(timeout_ms: int) -> bool:
        if not pull.poll(timeout_ms):
            return False
        with contextlib.suppress(BadMessageError, ValueError):
            got_id, rank, _, _ = codec.unpack(pull.recv())
            if got_id == SHUTDOWN:
                left.add(rank)
            elif rank in remote.last_seen:
                remote.last_seen[rank] = time.monotonic()
        return True

    while take(0):  # heartbeats not read yet: who is still there
        pass
    leaving = remote.alive() - left  # a rank already silent is not waited for
    while leaving and time.monotonic() < deadline:
        take(50)
        leaving -= left
    if leaving:
        logger.warning("remote ranks %s did not confirm the shutdown; they leave when they "
                       "notice the engine is gone", sorted(leaving))
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    procs.clear()
    pub.sock.close(linger=1000)  # a refusal or the shutdown still on its way to a remote rank
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
