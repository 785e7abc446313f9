"""Client disconnects abort engine requests; /health, /version, /metrics, /v1/models."""

import asyncio
import json

import httpx
from fake_engine import FakeAsyncLLM

from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import FinishedRequestStats, IterationStats
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.openai.metrics import PrometheusStatLogger
from bladellm.entrypoints.api_server import build_app
from bladellm.sampling_params import SamplingParams


async def _call(app, path: str, body: dict, disconnect: asyncio.Event) -> list[dict]:
    """Drive the ASGI app like uvicorn does; ``disconnect`` set = the client went away."""
    data = json.dumps(body).encode()
    sent: list[dict] = []
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


async def test_disconnect_while_waiting_for_a_non_streaming_response_aborts():
    engine = FakeAsyncLLM(step_delay=0.01)
    app = build_app(engine, ServerConfig())
    gone = asyncio.Event()

    async def leave_after_first_token():
        await engine.started.wait()
        gone.set()

    leaver = asyncio.ensure_future(leave_after_first_token())
    await _call(app, "/v1/completions", {"prompt": "x", "max_tokens": 100}, gone)
    await leaver
    (_, _, request_id), = engine.calls
    assert engine.aborted == [request_id] and not engine.active


async def test_disconnect_mid_stream_aborts():
    engine = FakeAsyncLLM(step_delay=0.005)
    app = build_app(engine, ServerConfig())
    gone = asyncio.Event()

    async def leave_after_first_token():
        await engine.started.wait()
        gone.set()

    leaver = asyncio.ensure_future(leave_after_first_token())
    sent = await _call(app, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
                        "stream": True}, gone)
    await leaver
    assert sent[0]["status"] == 200
    assert not any(m.get("body", b"").startswith(b"data: [DONE]") for m in sent)
    (_, _, request_id), = engine.calls
    assert engine.aborted == [request_id] and not engine.active


async def test_disconnect_aborts_every_prompt_of_a_batch():
    engine = FakeAsyncLLM(step_delay=0.01)
    app = build_app(engine, ServerConfig())
    gone = asyncio.Event()

    async def leave():
        await engine.started.wait()
        gone.set()

    leaver = asyncio.ensure_future(leave())
    await _call(app, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 100,
                                         "stream": True}, gone)
    await leaver
    assert sorted(engine.aborted) == sorted(rid for _, _, rid in engine.calls)
    assert len(engine.aborted) == 3 and not engine.active


async def test_health_version_models(client):
    r = await client.get("/health")
    assert r.status_code == 200
    version = (await client.get("/version")).json()["version"]
    assert isinstance(version, str) and version
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert {"created", "owned_by"} <= set(card) and card["max_model_len"] == 128


async def test_metrics_endpoint():
    engine = FakeAsyncLLM()
    metrics = PrometheusStatLogger()
    app = build_app(engine, ServerConfig(), metrics=metrics)
    metrics.record(SchedulerStats(num_running=1, prefix_cache_queries=10, prefix_cache_hits=4,
                                  num_preemptions=2),
                   IterationStats(time_to_first_tokens=[0.05], inter_token_latencies=[0.01, 0.02],
                                  num_prompt_tokens=7, num_generation_tokens=3),
                   [FinishedRequestStats("length", 0.5, 0.01, 7, 3, 0)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        # A running request shows up in the gauges taken at scrape time.
        gen = engine.generate("x", SamplingParams(max_tokens=5), "r1")
        await anext(gen)
        text = (await client.get("/metrics")).text
        assert "bladellm_kv_cache_used_blocks 2.0" in text
        assert "bladellm_num_requests_running 1.0" in text
        await gen.aclose()
        text = (await client.get("/metrics")).text
    assert "bladellm_kv_cache_used_blocks 0.0" in text
    assert "bladellm_time_to_first_token_seconds_count 1.0" in text
    assert "bladellm_time_between_tokens_seconds_count 2.0" in text
    assert "bladellm_e2e_request_latency_seconds_count 1.0" in text
    assert "bladellm_request_queue_time_seconds_count 1.0" in text
    assert "bladellm_prompt_tokens_total 7.0" in text
    assert "bladellm_generation_tokens_total 3.0" in text
    assert "bladellm_num_preemptions_total 2.0" in text
    assert "bladellm_prefix_cache_hit_rate 0.4" in text
    assert 'bladellm_request_success_total{finished_reason="length"} 1.0' in text
    assert 'bladellm_request_success_total{finished_reason="stop"} 0.0' in text
