"""Executors: how the engine core reaches its workers (one per rank).

``Executor`` is the interface the engine core uses; ``UniProcExecutor`` runs the single worker of
world size 1 inside the engine-core process. A multi-process executor (a process per rank, one
broadcast of each ``SchedulerOutput``) implements the same interface.
"""

from bladellm.executor.base import Executor, get_executor_class
from bladellm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "get_executor_class"]
