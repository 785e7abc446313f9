"""CPU thread settings, chosen per process.

The engine core runs the model's GEMMs on ``default_engine_threads`` torch threads; the API
process keeps torch to one thread so that tokenization and HTTP never compete with the model for
cores.

OpenMP wait policy: after a parallel region libgomp's worker threads spin (by default 300,000
polls) before they sleep. On a shared machine a long spin holds a core that a preempted
team-mate needs, and every region ends waiting for the thread the scheduler set aside: decode
collapses next to a busy process. Sleeping at once (PASSIVE) avoids that but pays a futex
wake-up at each of the hundreds of parallel regions of a step. A short spin of 1,000 polls
(``GOMP_SPINCOUNT=1000``) bridges the gaps between the kernels of a step and still sleeps
between steps: faster decode and serving than PASSIVE on a dedicated machine, and no collapse
next to a busy process (docs/cpu.md has the measurements).

libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it is loaded, i.e. when torch
is first imported in a process. So the engine-core process gets them in its environment before
it starts (``engine_process_env``); an engine that runs in the caller's process (the offline
``LLM``) sets them when it starts, before it loads torch (``apply_engine_omp_policy``), which is
why importing the engine must not import torch. A process that has already imported torch keeps
whatever its shell set. Nothing here runs at import: the engine calls these at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping

from bladellm import envs
from bladellm.platforms.cpu import detect_cpu

logger = logging.getLogger(__name__)

# GOMP_SPINCOUNT is libgomp's (torch's CPU wheels); an Intel OpenMP build of torch ignores it and
# gets KMP_BLOCKTIME=0 (sleep at once, the passive policy), which has not been measured against a
# short block time here.
ENGINE_OMP_ENV = {"GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}


def default_engine_threads(num_cpus: int) -> int:
    """Torch threads for the engine core on a machine where this process may use ``num_cpus``
    CPUs (affinity, cut by a cgroup quota): one per CPU."""
    return max(1, num_cpus)


def engine_threads(num_threads: int | None, num_cpus: int,
                   environ: Mapping[str, str] | None = None) -> int:
    """``--num_threads`` if given, else ``OMP_NUM_THREADS`` if set, else one per usable CPU."""
    if num_threads is not None:
        return num_threads
    return envs.omp_num_threads(environ) or default_engine_threads(num_cpus)


def configure_engine_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for the engine core; returns the number chosen."""
    import torch

    cpu = detect_cpu()
    n = engine_threads(num_threads, cpu.num_cpus)
    if n > cpu.num_cpus:
        # Allowed (a user may know better, e.g. SMT siblings the affinity mask hides), but
        # threads past the usable CPUs wait on each other at every parallel region's barrier.
        logger.warning("%d engine threads (--num_threads or OMP_NUM_THREADS) for %d usable "
                       "CPUs: the threads oversubscribe them and each step waits on the ones "
                       "set aside (docs/cpu.md)", n, cpu.num_cpus)
    torch.set_num_threads(n)
    waits = [f"{k}={v}" for k, v in envs.omp_wait_settings().items()]
    logger.info("engine threads: %d (%d usable CPUs; OpenMP %s)", n, cpu.num_cpus,
                " ".join(waits) or "default wait policy (spins)")
    return n


def configure_frontend_threads() -> None:
    """The API process does no tensor work and never imports torch itself (importing it would
    add seconds and a large heap to the process). Where torch is loaded anyway (AsyncLLM embedded in
    a program that uses it), its intra-op pool is kept to one thread, off the engine's CPUs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def engine_process_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to add to the engine-core process's environment before it starts: the OpenMP
    wait policy of ``ENGINE_OMP_ENV``, unless the user set any OpenMP wait setting already."""
    return {} if envs.omp_wait_settings(environ) else dict(ENGINE_OMP_ENV)


def apply_engine_omp_policy() -> bool:
    """For an engine that runs in this process (the offline ``LLM``): set the engine's OpenMP
    wait policy now if OpenMP has not started yet, i.e. torch is not imported. Returns whether it
    could; once torch is loaded, libgomp has read its settings for good."""
    if "torch" in sys.modules:
        return False
    os.environ.update(engine_process_env())
    return True


@contextlib.contextmanager
def process_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration (a spawned child copies the environment
    when it starts), then restore the previous values."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
