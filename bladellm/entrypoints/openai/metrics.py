"""Prometheus metrics for /metrics: a ``StatLogger`` fed by the engine front end.

Each logger owns its ``CollectorRegistry`` so that several apps (tests) never collide in the
global registry. Cumulative counts that the engine core reports as running totals (prompt-cache
lookups, preemptions) are turned into counter increments here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import FinishedRequestStats, IterationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_PREFIX = "bladellm_"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class PrometheusStatLogger:
    """Implements ``bladellm.engine.metrics.StatLogger``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = _PREFIX
        self.ttft = Histogram(f"{p}time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram(f"{p}time_between_tokens_seconds",
                             "Time between consecutive generated tokens of a request.",
                             buckets=_TBT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds",
                             "Time from arrival to the end of a request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{p}request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(
            f"{p}request_prompt_tokens", "Prompt length of finished requests.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            f"{p}request_generation_tokens", "Generated tokens of finished requests.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests in the running batch.",
                             registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting to be scheduled.",
                             registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_ratio",
                              "Fraction of KV-cache blocks held by requests (0..1).", registry=r)
        self.kv_used_blocks = Gauge(f"{p}kv_cache_used_blocks",
                                    "KV-cache blocks held by requests.", registry=r)
        self.kv_total_blocks = Gauge(f"{p}kv_cache_total_blocks", "KV-cache blocks in all.",
                                     registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries",
                                      "Prompt tokens looked up in the prompt cache.", registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits",
                                   "Prompt tokens found in the prompt cache.", registry=r)
        self.prefix_hit_rate = Gauge(f"{p}prefix_cache_hit_rate",
                                     "Prompt-cache hits / lookups (tokens) since start.",
                                     registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of requests.",
                                     registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens.",
                                         registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Requests preempted (KV blocks ran "
                                                         "out) since start.", registry=r)
        self.finished = Counter(f"{p}request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(finished_reason=reason)
        self._last: SchedulerStats | None = None

    # StatLogger ------------------------------------------------------------------------------

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               finished: list[FinishedRequestStats]) -> None:
        if scheduler_stats is not None:
            self.update_scheduler_stats(scheduler_stats)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.tbt.observe(value)
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
                              (self.preemptions, "num_preemptions")):
            now = getattr(stats, attr)
            before = getattr(last, attr) if last is not None else 0
            # A smaller total means the core restarted: count from its new zero.
            delta = now - before if now >= before else now
            if delta > 0:
                counter.inc(delta)
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

    def zero_engine_gauges(self) -> None:
        """A dead engine core runs nothing and holds no blocks: never show its last state."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.kv_used_blocks):
            gauge.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
