"""Prometheus metrics for /metrics: a ``StatLogger`` fed by the engine front end.

Every metric is published under vLLM's name with a ``model_name`` label
(``vllm:time_to_first_token_seconds{model_name="..."}``), so dashboards built for vLLM work
unchanged, and/or under our own ``bladellm_*`` name; ``--metrics_names`` picks (``both`` by
default). Each logger owns its ``CollectorRegistry`` so that several apps (tests) never collide
in the global registry. Cumulative counts that the engine core reports as running totals
(prompt-cache lookups, preemptions) are turned into counter increments here.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bladellm.core.step_phases import PHASES
from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import FinishedRequestStats, IterationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
METRICS_NAMES = ("both", "vllm", "bladellm")
_PREFIX = "bladellm_"
_VLLM = "vllm:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _Fan:
    """One logical metric published under one or more names: forwards every update."""

    def __init__(self, parents: list[tuple[Any, dict[str, str]]]) -> None:
        self._parents = parents  # (prometheus metric, labels bound up front)
        # Metrics with labels beyond the bound ones get their children from labels().
        self._children = [m.labels(**bound) if bound else m for m, bound in parents
                          if len(m._labelnames) == len(bound)]

    def labels(self, **labels: str) -> "_Fan":
        fan = _Fan([])
        fan._children = [m.labels(**bound, **labels) for m, bound in self._parents]
        return fan

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for child in self._children:
            child.inc(value)

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)


class PrometheusStatLogger:
    """Implements ``bladellm.engine.metrics.StatLogger``."""

    def __init__(self, registry: CollectorRegistry | None = None, *, model_name: str = "",
                 names: str = "both") -> None:
        if names not in METRICS_NAMES:
            raise ValueError(f"--metrics_names: must be one of {METRICS_NAMES}, got {names!r}")
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._names = names
        self.ttft = self._metric(Histogram, "time_to_first_token_seconds", None,
                                 "Time from arrival to the first generated token.",
                                 buckets=_LATENCY_BUCKETS)
        # vLLM publishes the same per-token observations under both names (the second is the
        # older one, still used by its example dashboards).
        self.tbt = self._metric(Histogram, "time_between_tokens_seconds",
                                ("inter_token_latency_seconds", "time_per_output_token_seconds"),
                                "Time between consecutive generated tokens of a request.",
                                buckets=_TBT_BUCKETS)
        self.e2e = self._metric(Histogram, "e2e_request_latency_seconds", None,
                                "Time from arrival to the end of a request.",
                                buckets=_LATENCY_BUCKETS)
        self.queue_time = self._metric(Histogram, "request_queue_time_seconds", None,
                                       "Time a request waited before it was first scheduled.",
                                       buckets=_LATENCY_BUCKETS)
        self.request_prompt_tokens = self._metric(
            Histogram, "request_prompt_tokens", None, "Prompt length of finished requests.",
            buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = self._metric(
            Histogram, "request_generation_tokens", None,
            "Generated tokens of finished requests.", buckets=_TOKEN_BUCKETS)
        self.running = self._metric(Gauge, "num_requests_running", None,
                                    "Requests in the running batch.")
        self.waiting = self._metric(Gauge, "num_requests_waiting", None,
                                    "Requests waiting to be scheduled.")
        self.kv_usage = self._metric(Gauge, "kv_cache_usage_ratio", ("kv_cache_usage_perc",),
                                     "Fraction of KV-cache blocks held by requests (0..1).")
        self.kv_used_blocks = self._metric(Gauge, "kv_cache_used_blocks", (),
                                           "KV-cache blocks held by requests.")
        self.kv_total_blocks = self._metric(Gauge, "kv_cache_total_blocks", (),
                                            "KV-cache blocks in all.")
        self.prefix_queries = self._metric(Counter, "prefix_cache_queries", None,
                                           "Prompt tokens looked up in the prompt cache.")
        self.prefix_hits = self._metric(Counter, "prefix_cache_hits", None,
                                        "Prompt tokens found in the prompt cache.")
        self.prefix_hit_rate = self._metric(Gauge, "prefix_cache_hit_rate", (),
                                            "Prompt-cache hits / lookups (tokens) since start.")
        self.prompt_tokens = self._metric(Counter, "prompt_tokens", None,
                                          "Prompt tokens of requests.")
        self.generation_tokens = self._metric(Counter, "generation_tokens", None,
                                              "Generated tokens.")
        self.preemptions = self._metric(Counter, "num_preemptions", None,
                                        "Requests preempted (KV blocks ran out) since start.")
        self.grammar_compiles = self._metric(
            Gauge, "guided_grammar_compiles", (),
            "Grammars compiled for structured output (cumulative).")
        self.grammar_cache_hits = self._metric(
            Gauge, "guided_grammar_cache_hits", (),
            "Structured-output requests served by the compiled-grammar cache (cumulative).")
        # Speculative decoding (vLLM's names; docs/speculative.md).
        self.spec_drafts = self._metric(Counter, "spec_decode_num_drafts", None,
                                        "Request-steps that verified proposed tokens.")
        self.spec_draft_tokens = self._metric(Counter, "spec_decode_num_draft_tokens", None,
                                              "Proposed tokens verified.")
        self.spec_accepted_tokens = self._metric(Counter, "spec_decode_num_accepted_tokens",
                                                 None, "Proposed tokens accepted.")
        self.spec_declined = self._metric(
            Counter, "spec_decode_declined", (),
            "sps: request-steps whose draft did not run, by reason (cost: the cost rule found "
            "plain decoding faster; length: too few tokens left).", labelnames=("reason",))
        for reason in ("cost", "length"):
            self.spec_declined.labels(reason=reason)
        # Where the engine's steps spend their time, and how many steps ran
        # (core/step_phases.py; benchmarks/step_split.py divides one by the other).
        self.step_phase_seconds = self._metric(
            Counter, "engine_step_phase_seconds", (),
            "Wall seconds of the engine core's steps by phase (recv, schedule, prepare, "
            "forward, logits, sample, executor, update, send).", labelnames=("phase",))
        for phase in PHASES:
            self.step_phase_seconds.labels(phase=phase)
        self.engine_steps = self._metric(Counter, "engine_steps", (),
                                         "Engine steps that ran a batch.")
        self.output_processing_seconds = self._metric(
            Counter, "api_output_processing_seconds", (),
            "Seconds the API process spent turning the engine's outputs into responses "
            "(detokenization, stop strings, logprobs), on its event loop.")
        # The API process's own CPU time, memory and open files (process_* metrics).
        ProcessCollector(registry=self.registry)
        self.finished = self._metric(Counter, "request_success", None,
                                     "Finished requests by finish reason.",
                                     labelnames=("finished_reason",))
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason)
        self._last: SchedulerStats | None = None

    def _metric(self, kind: type, name: str, vllm_names: tuple[str, ...] | None, doc: str,
                labelnames: tuple[str, ...] = (), **kwargs: Any) -> _Fan:
        """``name`` as ``bladellm_<name>``; ``vllm_names`` (None: the same name, (): none) as
        ``vllm:<name>`` with a ``model_name`` label."""
        parents: list[tuple[Any, dict[str, str]]] = []
        if self._names in ("both", "bladellm"):
            parents.append((kind(f"{_PREFIX}{name}", doc, list(labelnames),
                                 registry=self.registry, **kwargs), {}))
        if self._names in ("both", "vllm"):
            for vname in (name,) if vllm_names is None else vllm_names:
                parents.append((kind(f"{_VLLM}{vname}", doc, ["model_name", *labelnames],
                                     registry=self.registry, **kwargs),
                                {"model_name": self.model_name}))
        return _Fan(parents)

    # StatLogger ------------------------------------------------------------------------------

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               finished: list[FinishedRequestStats]) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.tbt.observe(value)
        if iteration.output_processing_seconds:
            self.output_processing_seconds.inc(iteration.output_processing_seconds)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        for req in finished:
            self.finished.labels(finished_reason=req.finish_reason).inc()
            self.e2e.observe(req.e2e_latency)
            self.queue_time.observe(req.queued_time)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)

    # ------------------------------------------------------------------------------------------

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Gauges from the latest snapshot; counters from the growth of the running totals."""
        self.update_gauges(stats)
        last = self._last
        for counter, attr in ((self.prefix_queries, "prefix_cache_queries"),
                              (self.prefix_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions"),
                              (self.spec_drafts, "num_spec_drafts"),
                              (self.spec_draft_tokens, "num_spec_draft_tokens"),
                              (self.spec_accepted_tokens, "num_spec_accepted_tokens"),
                              (self.engine_steps, "num_steps")):
            now = getattr(stats, attr)
            before = getattr(last, attr) if last is not None else 0
            # A smaller total means the core restarted: count from its new zero.
            delta = now - before if now >= before else now
            if delta > 0:
                counter.inc(delta)
        for phase, now in stats.step_seconds.items():
            before = last.step_seconds.get(phase, 0.0) if last is not None else 0.0
            delta = now - before if now >= before else now
            if delta > 0:
                self.step_phase_seconds.labels(phase=phase).inc(delta)
        for reason, now in stats.num_spec_declined.items():
            before = last.num_spec_declined.get(reason, 0) if last is not None else 0
            delta = now - before if now >= before else now
            if delta > 0:
                self.spec_declined.labels(reason=reason).inc(delta)
        if stats.prefix_cache_queries:
            self.prefix_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        self._last = stats

    def update_gauges(self, stats: SchedulerStats) -> None:
        """Only the point-in-time values; safe to call at scrape time with any snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_used_blocks.set(stats.num_used_blocks)
        self.kv_total_blocks.set(stats.num_total_blocks)
        self.grammar_compiles.set(stats.num_grammar_compiles)
        self.grammar_cache_hits.set(stats.num_grammar_cache_hits)

    def zero_engine_gauges(self) -> None:
        """A dead engine core runs nothing and holds no blocks: never show its last state."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.kv_used_blocks):
            gauge.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
