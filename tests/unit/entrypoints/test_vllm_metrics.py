"""/metrics under vLLM's names with a model_name label, so vLLM dashboards work unchanged."""

import httpx
import pytest
from fake_engine import FakeAsyncLLM
from prometheus_client.parser import text_string_to_metric_families

from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import FinishedRequestStats, IterationStats
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.openai.metrics import PrometheusStatLogger
from bladellm.entrypoints.api_server import build_app

VLLM_NAMES = [
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
    "vllm:request_success"]


def _samples(m: PrometheusStatLogger) -> dict:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _feed(m: PrometheusStatLogger) -> None:
    m.record(SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                            prefix_cache_queries=8, prefix_cache_hits=2, num_preemptions=1),
             IterationStats(time_to_first_tokens=[0.05], inter_token_latencies=[0.01, 0.02],
                            num_prompt_tokens=7, num_generation_tokens=3),
             [FinishedRequestStats("stop", 0.5, 0.01, 7, 3, 0)])


def test_vllm_names_carry_model_name_and_the_same_values():
    m = PrometheusStatLogger(model_name="org/model")
    _feed(m)
    s = _samples(m)
    label = (("model_name", "org/model"),)
    families = {name for name, _ in s}
    for name in VLLM_NAMES:
        assert any(f.startswith(name) for f in families), name
    assert s[("vllm:num_requests_running", label)] == 3
    assert s[("vllm:kv_cache_usage_perc", label)] == 0.25
    assert s[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert s[("vllm:inter_token_latency_seconds_count", label)] == 2
    assert s[("vllm:time_per_output_token_seconds_sum", label)] == pytest.approx(0.03)
    assert s[("vllm:prompt_tokens_total", label)] == 7
    assert s[("vllm:prefix_cache_hits_total", label)] == 2
    assert s[("vllm:request_success_total", (("finished_reason", "stop"),) + label)] == 1
    # bladellm_* agree
    assert s[("bladellm_num_requests_running", ())] == 3
    assert s[("bladellm_time_between_tokens_seconds_count", ())] == 2


@pytest.mark.parametrize("names,has_vllm,has_ours", [("vllm", True, False),
                                                      ("bladellm", False, True)])
def test_one_switch_picks_the_names(names, has_vllm, has_ours):
    m = PrometheusStatLogger(model_name="x", names=names)
    _feed(m)
    families = {name for name, _ in _samples(m)}
    assert any(f.startswith("vllm:") for f in families) == has_vllm
    assert any(f.startswith("bladellm_") for f in families) == has_ours


def test_bad_switch_value():
    with pytest.raises(ValueError, match="--metrics_names"):
        ServerConfig(metrics_names="prom")


async def test_server_labels_with_the_served_model_name():
    app = build_app(FakeAsyncLLM(), ServerConfig(metrics_names="vllm"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        text = (await client.get("/metrics")).text
    assert 'vllm:num_requests_running{model_name="fake-model"} 0.0' in text
    assert "bladellm_" not in text


def test_grafana_dashboard_uses_only_series_we_publish():
    import json
    import pathlib
    import re

    path = pathlib.Path(__file__).parents[3] / "docs/grafana/bladellm-vllm-dashboard.json"
    exprs = [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"vllm:[a-z0-9_]+", e)}
    m = PrometheusStatLogger(model_name="x", names="vllm")
    _feed(m)
    published = {name for name, _ in _samples(m)}
    assert used and used <= published, used - published
    assert all('model_name=~"$model_name"' in e for e in exprs)
