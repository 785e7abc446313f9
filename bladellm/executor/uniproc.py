"""World size 1: the worker lives in the engine-core process and is called directly."""

from __future__ import annotations

from typing import Any

from bladellm.config import EngineConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.executor.base import Executor, StepHandle
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        super().__init__(config, resolved)
        self.worker = Worker(config, resolved, rank=0)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Launch the step (on a CPU it runs to the end here); the handle's ``result()`` reads
        its sampled ids, so the engine can schedule and launch the next step first
        (--async_scheduling)."""
        return self.worker.execute_model_async(sched)

    def shutdown(self) -> None:
        self.worker.shutdown()
