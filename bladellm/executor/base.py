"""The executor interface: the engine core's only way to its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from bladellm.config import EngineConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.checkpoint.locate import ResolvedModel


class WorkerDiedError(RuntimeError):
    """A worker process is gone or stopped answering: the engine cannot go on (unlike a step
    that failed on live workers, which fails only its requests)."""


class StepHandle(Protocol):
    def result(self) -> ModelRunnerOutput:
        """The step's output (waits for it); raises what the step raised."""


@dataclass
class DoneStep:
    """A step that already ran (executors that run one step at a time)."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    # The rank whose answer is the step's output (the one that samples).
    driver_rank: int = 0
    # Steps the engine core may publish before it waits for the oldest: the pipeline depth.
    max_concurrent_batches: int = 1

    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.config = config
        self.resolved = resolved

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; results in rank order."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all ranks; the output of the rank that samples (rank 0 / last stage)."""

    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Start a step; ``max_concurrent_batches`` of them may be in flight. Default: run it
        now."""
        return DoneStep(self.execute_model(sched))

    def determine_num_blocks(self) -> int:
        """Every rank must fit the pool: the smallest of their answers."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def drop_requests(self, req_ids: list[str]) -> None:
        self.collective_rpc("drop_requests", (req_ids,))

    def check_health(self) -> None:
        """Raises if any worker is dead or unresponsive."""
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        """Stop the workers; where they live in this process (``UniProcExecutor``), let go of
        their model and KV cache and return the device memory, so that a later engine in this
        process starts with it."""

