"""Executors: how the engine core reaches its workers (one per rank).

``Executor`` is the interface the engine core uses; ``UniProcExecutor`` runs the single worker of
world size 1 inside the engine-core process; ``MultiprocExecutor`` (world size > 1) runs a
process per rank and publishes each ``SchedulerOutput`` once to all of them.
"""

from bladellm.config import EngineConfig
from bladellm.executor.base import Executor, WorkerDiedError


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for the configured world size. Each is imported only when chosen: the
    in-process one brings the worker and torch with it, which must not load before the engine
    has set the OpenMP policy (``platforms.threads``); the multiprocess one the transport."""
    if config.parallel.world_size == 1:
        from bladellm.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    from bladellm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor


__all__ = ["Executor", "WorkerDiedError", "get_executor_class"]
