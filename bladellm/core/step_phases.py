"""Where an engine step's time goes: cumulative wall seconds per phase.

The engine core, its runner and its process loop each add the phases they run; the totals travel
to the API process in ``SchedulerStats.step_seconds`` and out as the Prometheus counter
``bladellm_engine_step_phase_seconds_total{phase}``. Divided by the growth of ``num_steps`` over a
load run, they give the per-step split (``benchmarks/step_split.py``; docs/benchmarks.md).

Phases (the engine core process):

- ``recv``: decoding the API process's messages and adding their requests;
- ``schedule``: the scheduler's decision (and the grammar bitmask it needs);
- ``prepare``: the runner applying the decision to its persistent batch and building the flat
  step inputs (ids, positions, slot mapping, block tables, sampling metadata);
- ``forward``: the model up to the hidden states (embedding, layers, final norm);
- ``logits``: the LM head over the rows that sample;
- ``sample``: sampling and reading the sampled ids (and logprobs) to the host;
- ``executor``: the rest of the executor's round trip (nothing in-process; messages to and from
  the workers with tensor / pipeline parallelism);
- ``update``: applying the sampled tokens (stops, finished requests, freed blocks, stats);
- ``send``: encoding the step's outputs and handing them to the socket.

The runner's phases are measured on the driver rank. On a GPU they are host times: the device
runs behind the host until ``sample`` reads the ids.
"""

from __future__ import annotations

import time

RUNNER_PHASES = ("prepare", "forward", "logits", "sample")
PHASES = ("recv", "schedule", *RUNNER_PHASES, "executor", "update", "send")


class PhaseClock:
    """Running totals of wall seconds per phase (one per engine core)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def add_all(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.add(phase, seconds)

    def since(self, phase: str, start: float) -> float:
        """Add the time from ``start`` (a ``time.perf_counter()`` reading) to now; returns now."""
        now = time.perf_counter()
        self.add(phase, now - start)
        return now

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
