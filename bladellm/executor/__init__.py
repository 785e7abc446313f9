"""Executors: how the engine core reaches its workers (one per rank).

``Executor`` is the interface the engine core uses; ``UniProcExecutor`` runs the single worker of
world size 1 inside the engine-core process; ``MultiprocExecutor`` (world size > 1) runs a
process per rank and publishes each ``SchedulerOutput`` once to all of them.
"""

from bladellm.executor.base import Executor, WorkerDiedError, get_executor_class
from bladellm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "WorkerDiedError", "get_executor_class"]
