"""A step's output whose sampled ids may still be on the device.

``ModelRunner.execute_model_async`` returns once the step is launched; ``result()`` reads the
sampled ids (and logprobs) to the host, the step's one host sync. With ``--async_scheduling``
the engine schedules and launches the next step before it calls ``result()`` (docs/scheduler.md).
"""

from __future__ import annotations

from collections.abc import Callable

from bladellm.core.interface import ModelRunnerOutput


class DeferredOutput:
    def __init__(self, finish: Callable[[], ModelRunnerOutput]) -> None:
        self._finish = finish
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> "DeferredOutput":
        done = cls(lambda: output)
        done.result()
        return done

    def result(self) -> ModelRunnerOutput:
        """The step's output (read once; later calls return it again)."""
        if self._output is None:
            self._output = self._finish()
        return self._output
