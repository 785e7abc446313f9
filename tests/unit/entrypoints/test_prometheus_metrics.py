"""PrometheusStatLogger: counters from running totals, gauges from snapshots."""

from prometheus_client.parser import text_string_to_metric_families

from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import FinishedRequestStats, IterationStats
from bladellm.entrypoints.openai.metrics import PrometheusStatLogger


def _values(logger: PrometheusStatLogger) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for s in family.samples:
            key = s.name + (str(sorted(s.labels.items())) if s.labels else "")
            out[key] = s.value
    return out


def test_cumulative_core_totals_become_counter_increments():
    m = PrometheusStatLogger()
    m.record(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=25, num_preemptions=1),
             IterationStats(), [])
    m.record(SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=75, num_preemptions=3),
             IterationStats(), [])
    v = _values(m)
    assert v["bladellm_prefix_cache_queries_total"] == 150
    assert v["bladellm_prefix_cache_hits_total"] == 75
    assert v["bladellm_prefix_cache_hit_rate"] == 0.5
    assert v["bladellm_num_preemptions_total"] == 3
    # An iteration without scheduler stats changes none of them.
    m.record(None, IterationStats(num_generation_tokens=4), [])
    v = _values(m)
    assert v["bladellm_num_preemptions_total"] == 3 and v["bladellm_generation_tokens_total"] == 4


def test_gauges_follow_the_latest_snapshot():
    m = PrometheusStatLogger()
    m.record(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.5, num_used_blocks=8,
                            num_total_blocks=16), IterationStats(), [])
    m.record(SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_used_blocks=0,
                            num_total_blocks=16), IterationStats(), [])
    v = _values(m)
    assert (v["bladellm_num_requests_running"], v["bladellm_num_requests_waiting"]) == (0, 0)
    assert v["bladellm_kv_cache_used_blocks"] == 0 and v["bladellm_kv_cache_total_blocks"] == 16
    assert v["bladellm_kv_cache_usage_ratio"] == 0


def test_finished_requests_by_reason_and_histograms():
    m = PrometheusStatLogger()
    m.record(None, IterationStats(time_to_first_tokens=[0.1, 0.2]), [
        FinishedRequestStats("stop", 1.0, 0.1, 10, 5, 0),
        FinishedRequestStats("abort", 2.0, 0.2, 10, 1, 0),
        FinishedRequestStats("stop", 3.0, 0.0, 10, 7, 8)])
    v = _values(m)
    assert v["bladellm_request_success_total[('finished_reason', 'stop')]"] == 2
    assert v["bladellm_request_success_total[('finished_reason', 'abort')]"] == 1
    assert v["bladellm_time_to_first_token_seconds_count"] == 2
    assert v["bladellm_e2e_request_latency_seconds_sum"] == 6.0
    assert v["bladellm_request_generation_tokens_sum"] == 13


def test_each_logger_has_its_own_registry():
    a, b = PrometheusStatLogger(), PrometheusStatLogger()  # no duplicate-registration error
    a.record(None, IterationStats(num_prompt_tokens=5), [])
    assert _values(b)["bladellm_prompt_tokens_total"] == 0


def test_step_phase_totals_become_counters_per_phase():
    m = PrometheusStatLogger()
    m.record(SchedulerStats(num_steps=10, step_seconds={"forward": 0.5, "schedule": 0.01}),
             IterationStats(output_processing_seconds=0.002), [])
    m.record(SchedulerStats(num_steps=30, step_seconds={"forward": 1.5, "schedule": 0.03,
                                                        "send": 0.004}),
             IterationStats(output_processing_seconds=0.003), [])
    v = _values(m)
    assert v["bladellm_engine_steps_total"] == 30
    assert v["bladellm_engine_step_phase_seconds_total[('phase', 'forward')]"] == 1.5
    assert v["bladellm_engine_step_phase_seconds_total[('phase', 'schedule')]"] == 0.03
    assert v["bladellm_engine_step_phase_seconds_total[('phase', 'send')]"] == 0.004
    # Every phase is published from the start, at 0 until it runs.
    assert v["bladellm_engine_step_phase_seconds_total[('phase', 'executor')]"] == 0
    assert abs(v["bladellm_api_output_processing_seconds_total"] - 0.005) < 1e-12
    # A restarted core counts from its new zero.
    m.record(SchedulerStats(num_steps=2, step_seconds={"forward": 0.25}), IterationStats(), [])
    v = _values(m)
    assert v["bladellm_engine_steps_total"] == 32
    assert v["bladellm_engine_step_phase_seconds_total[('phase', 'forward')]"] == 1.75
    assert "process_cpu_seconds_total" in v  # the API process's own CPU time
