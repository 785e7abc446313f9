"""Executors: how the engine core reaches its workers (one per rank).

``Executor`` is the interface the engine core uses; ``UniProcExecutor`` runs the single worker of
world size 1 inside the engine-core process; ``MultiprocExecutor`` (world size > 1) runs a
process per rank and publishes each ``SchedulerOutput`` once to all of them.
"""

from bladellm.config import EngineConfig
from bladellm.executor.base import Executor, WorkerDiedError
from bladellm.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for the configured world size (the multiprocess one is imported only
    where it is used: it brings the transport with it)."""
    if config.parallel.world_size == 1:
        return UniProcExecutor
    from bladellm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor


__all__ = ["Executor", "UniProcExecutor", "WorkerDiedError", "get_executor_class"]
