"""World size > 1: one worker process per rank, driven from the engine-core process.

Transport (pyzmq over IPC sockets in a private temporary directory):

- one PUB socket: every call (``execute_model`` with its ``SchedulerOutput``, or a
  ``collective_rpc``) is pickled once and published once; every rank's SUB socket receives it;
- one PULL socket: every rank answers every call on its PUSH socket, ``(call_id, rank, ok,
  value)``; the driver (the rank that samples: TP rank 0 of the last pipeline stage) sends the
  step's result, the others ``None``. Answers from every rank are what lets a failure on any
  rank surface as an error instead of a hang.

Every rank runs the calls in the order they were published. Under pipeline parallelism the
engine core publishes up to ``--pipeline_parallel_size`` steps before it waits for the oldest
(``execute_model_async``): the first stage starts the next micro-batch while later stages work
on earlier ones. Answers to calls not waited for yet are kept until they are.

Tensors never cross this channel: the model's collectives (all-reduce, all-gather) run between
the workers on ``torch.distributed`` (gloo on CPU), rendezvous at ``--distributed_init_method``
or a free local TCP port.

Lifetime: workers are spawned (not forked: the engine core may hold threads and OpenMP state),
ask the kernel to SIGKILL them when the engine-core process dies (``PR_SET_PDEATHSIG``), and also
exit if their parent changes. The executor notices a dead rank while it waits for answers (it
polls the processes' liveness between short socket waits) and raises ``WorkerDiedError``, which
the engine core treats as fatal: the engine reports dead, clients get errors, nothing hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import weakref
from collections.abc import Iterator
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from bladellm.config import EngineConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.executor.base import Executor, WorkerDiedError
from bladellm.model.checkpoint import ResolvedModel
from bladellm.platforms.threads import engine_process_env, process_env

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often a waiting executor checks that every worker still lives
_OUT_OF_STEP_S = 30.0  # how long the other ranks may take once one rank's call failed
_READY_TIMEOUT_S = 600.0  # model load of the slowest rank
_PR_SET_PDEATHSIG = 1


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


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (even by SIGKILL); elsewhere the
    parent-pid check in the loop is the fallback."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (the server's engine core is one, so that it never outlives the
    API process) start the workers: multiprocessing refuses because a daemon's children could
    be orphaned when it is terminated. Ours cannot: they die with their parent
    (``_die_with_parent``) and check it in their loop."""
    config = multiprocessing.current_process()._config  # noqa: SLF001 - see above
    was = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


def _rank_threads(config: EngineConfig, local_world_size: int) -> int:
    """Torch threads per rank: ``--num_threads`` is the engine's total on this machine, shared
    by its ranks (default: one per usable CPU), so ranks never oversubscribe the cores."""
    from bladellm import envs
    from bladellm.platforms.cpu import detect_cpu

    total = (config.parallel.num_threads or envs.omp_num_threads()
             or detect_cpu().num_cpus)
    return max(1, total // local_world_size)


def worker_main(config: EngineConfig, resolved: ResolvedModel, rank: int, init_method: str,
                bcast_addr: str, result_addr: str, log_level: int) -> None:
    """Entry point of a worker process (rank ``rank``)."""
    _die_with_parent()
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    parent = os.getppid()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(bcast_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(result_addr)
    try:
        from bladellm.distributed.parallel_state import init_model_parallel
        from bladellm.worker.worker import Worker

        par = config.parallel
        init_model_parallel(rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                            init_method, backend="gloo")
        worker = Worker(config, resolved, rank=rank,
                        num_threads=_rank_threads(config, par.world_size),
                        local_world_size=par.world_size)
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure
        logger.exception("rank %d failed to start", rank)  # the traceback stays in our log
        push.send(pickle.dumps((-1, rank, False, f"{type(exc).__name__}: {exc}")))
        return
    push.send(pickle.dumps((-1, rank, True, None)))
    driver = config.parallel.driver_rank
    seen_ping = -1
    while True:
        if not sub.poll(1000):
            if os.getppid() != parent:
                return  # orphaned (no PDEATHSIG on this platform)
            continue
        call_id, method, args = pickle.loads(sub.recv())
        if method == "_ping":  # start-up handshake: answered once per rank
            if seen_ping < 0:
                seen_ping = call_id
                push.send(pickle.dumps((call_id, rank, True, None)))
            continue
        if method == "_shutdown":
            break
        try:
            value = getattr(worker, method)(*args)
            ok = True
        except Exception as exc:  # noqa: BLE001 - reported to the engine core
            # The message may reach a client (a failed step fails its requests with it): no
            # traceback or file paths in it; those go to this rank's log.
            logger.exception("rank %d: %s failed", rank, method)
            value, ok = f"{type(exc).__name__}: {exc}", False
        if method == "execute_model" and rank != driver:
            value = None  # the driver samples; the others only confirm they ran
        push.send(pickle.dumps((call_id, rank, ok, value), protocol=pickle.HIGHEST_PROTOCOL))
    from bladellm.distributed.parallel_state import reset_model_parallel

    channel = getattr(getattr(worker.model_runner.model, "model", None), "channel", None)
    if channel is not None:
        channel.wait()  # the last activations sent to the next stage
    reset_model_parallel()
    sub.close(linger=0)
    push.close()
    ctx.term()


def check_tensor_parallel(hf_config: Any, tp_size: int, model_dir: str | None = None,
                          pp_size: int = 1) -> None:
    """Refuse a degree the model cannot be split into (a rank would hold no query head, no
    intermediate column or no vocabulary row), or that differs from the degrees a
    ``blade_llm_split`` checkpoint at ``model_dir`` was split for, before any worker process
    starts."""
    from bladellm.distributed.partition import attention_partitions, even_shard
    from bladellm.model.loader import check_split_parallel, read_split_manifest

    if model_dir is not None and os.path.isdir(model_dir):
        manifest = read_split_manifest(model_dir)
        if manifest is not None:
            check_split_parallel(manifest, tp_size, pp_size, model_dir)

    heads = hf_config.num_attention_heads
    try:
        attention_partitions(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                             tp_size)
        for what in ("intermediate_size", "vocab_size"):
            if getattr(hf_config, what, None):
                even_shard(getattr(hf_config, what), tp_size, 0, what)
    except ValueError as exc:
        raise ValueError(f"--tensor_parallel_size {tp_size}: {exc}") from None


def check_pipeline_parallel(hf_config: Any, pp_size: int) -> None:
    """Refuse more stages than the model has layers, before any worker process starts."""
    from bladellm.distributed.partition import pipeline_stages

    try:
        pipeline_stages(hf_config.num_hidden_layers, pp_size)
    except ValueError as exc:
        raise ValueError(f"--pipeline_parallel_size {pp_size}: {exc}") from None


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        super().__init__(config, resolved)
        par = config.parallel
        check_tensor_parallel(resolved.hf_config, par.tensor_parallel_size,
                              None if resolved.gguf is not None else resolved.path,
                              par.pipeline_parallel_size)
        check_pipeline_parallel(resolved.hf_config, par.pipeline_parallel_size)
        self.world_size = par.world_size
        self.driver_rank = par.driver_rank
        self.max_concurrent_batches = par.pipeline_parallel_size
        # Answers read while waiting for another call: call_id -> {rank: (ok, value)}.
        self._answers: dict[int, dict[int, tuple[bool, Any]]] = {}
        self._ipc_dir = tempfile.mkdtemp(prefix="bladellm-workers-")
        bcast_addr = f"ipc://{self._ipc_dir}/bcast"
        result_addr = f"ipc://{self._ipc_dir}/result"
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._pub.bind(bcast_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(result_addr)
        self._next_call = 0
        self._last_ping = -1  # answers to calls up to this one are start-up pings
        self._dead: str | None = None
        init_method = par.distributed_init_method or f"tcp://127.0.0.1:{_free_tcp_port()}"
        mp = multiprocessing.get_context("spawn")
        log_level = logging.getLogger().level or logging.INFO
        self.procs: list[Any] = []
        # Runs once: at shutdown(), or when the executor is collected / the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self._pub,
                                           self._ctx, self._ipc_dir)
        try:
            with process_env(engine_process_env()), _children_allowed():
                for rank in range(self.world_size):
                    proc = mp.Process(target=worker_main, name=f"bladellm-worker-{rank}",
                                      daemon=True,
                                      args=(config, resolved, rank, init_method, bcast_addr,
                                            result_addr, log_level))
                    proc.start()
                    self.procs.append(proc)
            self._wait_started()
        except BaseException:
            self.shutdown()
            raise
        # Connected sockets outlive their IPC files: remove them now, so that an engine core
        # killed before shutdown() leaves nothing in the temporary directory.
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        logger.info("%d worker processes ready (tensor parallel %d, pipeline parallel %d, "
                    "rendezvous %s)", self.world_size, par.tensor_parallel_size,
                    par.pipeline_parallel_size, init_method)

    # ---- start-up -------------------------------------------------------------------------------
    def _wait_started(self) -> None:
        answers = self._gather(-1, timeout_s=_READY_TIMEOUT_S, what="start-up")
        del answers
        # A SUB socket receives only what is published after its subscription reached us: ping
        # until every rank has answered one, so that no step can be lost to a slow joiner.
        pending = set(range(self.world_size))
        deadline = time.monotonic() + 60
        while pending:
            self._last_ping = self._publish("_ping", ())
            if self._pull.poll(50):
                got_id, rank, _, _ = pickle.loads(self._pull.recv())
                if got_id >= 0:
                    pending.discard(rank)
            self._check_alive("start-up")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"worker ranks {sorted(pending)} did not answer")

    # ---- calls ----------------------------------------------------------------------------------
    def _publish(self, method: str, args: tuple[Any, ...]) -> int:
        call_id = self._next_call
        self._next_call += 1
        self._pub.send(pickle.dumps((call_id, method, args), protocol=pickle.HIGHEST_PROTOCOL))
        return call_id

    def _check_alive(self, what: str) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._dead = (f"worker rank {rank} (pid {proc.pid}) died during {what} "
                              f"(exit code {proc.exitcode})")
                raise WorkerDiedError(self._dead)

    def _gather(self, call_id: int, timeout_s: float | None = None,
                what: str = "a step") -> list[Any]:
        """Every rank's answer to ``call_id`` in rank order; raises on a failed or dead rank."""
        values: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))

        def take(rank: int, ok: bool, value: Any) -> None:
            pending.discard(rank)
            if ok:
                values[rank] = value
            else:
                errors[rank] = value

        for rank, (ok, value) in self._answers.pop(call_id, {}).items():
            take(rank, ok, value)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out_of_step_at = None  # set once a rank failed while others are still busy
        while pending:
            if self._pull.poll(_POLL_MS):
                got_id, rank, ok, value = pickle.loads(self._pull.recv())
                if got_id == call_id:
                    take(rank, ok, value)
                elif got_id >= 0 and got_id > self._last_ping:
                    # A call published earlier or later and not waited for yet: keep it.
                    self._answers.setdefault(got_id, {})[rank] = (ok, value)
                continue  # (or a late answer to a start-up ping)
            if errors:
                first = min(errors)
                if call_id < 0:  # report the cause now, not the exit of the rank that failed
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
        if errors:
            rank = min(errors)
            if call_id < 0:
                raise RuntimeError(f"worker rank {rank} failed to start: {errors[rank]}")
            raise RuntimeError(f"worker rank {rank}: {errors[rank]}")
        return values

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        return self._gather(self._publish(method, args), what=method)

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
        return PendingStep(self, self._publish("execute_model", (sched,)))

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


def _stop_workers(procs: list[Any], pub: zmq.Socket, ctx: zmq.Context, ipc_dir: str) -> None:
    """The executor's cleanup (a ``weakref.finalize`` callback: it must not hold the executor)."""
    if procs:
        try:
            pub.send(pickle.dumps((-2, "_shutdown", ())), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + 5
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        procs.clear()
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)
