"""Regression tests for the faults of issue 15: template kwargs that collided with the
rendering call (500), CPU work on the event loop, SIGTERM under load, uploads cut short, and
a dead engine's stale gauges."""

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from fake_engine import FakeAsyncLLM

from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import IterationStats
from bladellm.entrypoints.openai.config import ServerConfig
from bladellm.entrypoints.openai.metrics import PrometheusStatLogger
from bladellm.entrypoints.api_server import build_app

MSGS = [{"role": "user", "content": "hi"}]


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=30)


# ---------------------------------------------------------------- 1. chat_template_kwargs


async def test_template_kwargs_merge_generation_flags(engine, make_client):
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 1,
            "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": True}})
    assert r.status_code == 200, r.text
    prompt = engine.calls[-1][0]
    assert bytes(prompt[-len("<user>hi"):]).decode() == "<user>hi"  # no generation prompt
    assert engine.input_processor.last_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize("kwargs", [{"messages": 5}, {"conversation": []}, {"tokenize": True},
                                    {"return_dict": True}, {"tools": []}])
async def test_template_kwargs_reserved_keys_are_400(engine, make_client, kwargs):
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 1, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    (key,) = kwargs
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"
    assert not engine.calls


async def test_template_kwargs_bad_flag_type_and_conflict(engine, make_client):
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": "yes"}})
        assert r.status_code == 400
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "chat_template_kwargs": {"continue_final_message": True}})
        assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]


async def test_request_chat_template_needs_the_trust_flag(engine, make_client):
    body = {"messages": MSGS, "max_tokens": 1, "chat_template": "{{ messages[0].content }}"}
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "chat_template_not_allowed"
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "chat_template_kwargs": {"chat_template": "x"}})
        assert r.status_code == 400
    async with make_client(engine, trust_request_chat_template=True) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.input_processor.last_kwargs["chat_template"] == body["chat_template"]


# ------------------------------------------------------------ 2. CPU work off the event loop


async def test_chat_template_rendering_does_not_block_the_event_loop(engine, make_client):
    entered_at: list[float] = []
    render = engine.input_processor.apply_chat_template

    def slow_render(*args, **kwargs):  # a costly template: blocks whatever thread runs it
        entered_at.append(time.monotonic())
        time.sleep(1.5)
        return render(*args, **kwargs)

    engine.input_processor.apply_chat_template = slow_render
    async with make_client(engine) as client:
        chat = asyncio.ensure_future(client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 1}))
        while not entered_at:
            await asyncio.sleep(0.01)
        health = await client.get("/health")
        # On the loop, the render would hold it for 1.5 s before /health could be answered.
        waited = time.monotonic() - entered_at[0]
        assert (await chat).status_code == 200
    assert health.status_code == 200 and waited < 0.75, waited


async def test_echo_of_token_ids_decodes_off_the_loop(engine, make_client):
    decode = engine.model_info.tokenizer.decode
    threads = []

    def spy(ids, *a, **kw):
        threads.append(threading.current_thread().name)
        return decode(ids, *a, **kw)

    engine.model_info.tokenizer.decode = spy
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"prompt": [104, 105], "echo": True,
                                                       "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi")
    assert threads and all(name != threading.main_thread().name for name in threads)


# ------------------------------------------------------------------ 3. shutdown under load


async def test_drain_refuses_new_requests_and_fails_stragglers_with_error_bodies():
    engine = FakeAsyncLLM(step_delay=0.02)
    app = build_app(engine, ServerConfig(shutdown_timeout=0.3))
    lifecycle = app.state.lifecycle
    async with _client(app) as client:
        stream = asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 100, "stream": True}))
        full = asyncio.ensure_future(client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 100}))
        short = asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 3}))
        while len(engine.active) < 3:
            await asyncio.sleep(0.005)
        start = time.monotonic()
        drain = asyncio.ensure_future(lifecycle.drain(engine, 0.3))
        await asyncio.sleep(0.01)
        refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        health = await client.get("/health")
        metrics = await client.get("/metrics")
        await drain
        elapsed = time.monotonic() - start
        stream, full, short = await stream, await full, await short
    assert refused.status_code == 503 and health.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert refused.headers["retry-after"] == "1"
    assert metrics.status_code == 200
    assert short.status_code == 200  # finished within the grace period
    assert full.status_code == 503 and full.json()["error"]["code"] == "server_shutting_down"
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert 0.3 <= elapsed < 1.3, elapsed
    assert not engine.active and lifecycle.in_flight == 0


async def test_drain_returns_at_once_when_idle():
    engine = FakeAsyncLLM()
    app = build_app(engine, ServerConfig())
    start = time.monotonic()
    await app.state.lifecycle.drain(engine, 10.0)
    assert time.monotonic() - start < 0.5


# ------------------------------------------------------------- 4. client gone mid-upload


async def test_client_disconnect_mid_upload_is_not_an_error(engine, caplog):
    app = build_app(engine, ServerConfig())
    sent = []
    parts = [{"type": "http.request", "body": b'{"prompt": "x", ', "more_body": True},
             {"type": "http.disconnect"}]

    async def receive():
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", b"1000")],
             "client": ("127.0.0.1", 5000), "server": ("t", 80)}
    with caplog.at_level(logging.DEBUG):
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text
    assert sent[0]["status"] == 499 and not engine.calls


# ---------------------------------------------------------------------- 5. engine death


async def test_dead_engine_zeroes_the_engine_gauges():
    engine = FakeAsyncLLM()
    metrics = PrometheusStatLogger()
    app = build_app(engine, ServerConfig(), metrics=metrics)
    metrics.record(SchedulerStats(num_running=45, num_waiting=3, num_used_blocks=91,
                                  num_total_blocks=100, kv_cache_usage=0.91),
                   IterationStats(), [])
    engine.get_scheduler_stats = lambda: SchedulerStats(num_running=45, num_used_blocks=91)
    engine.dead_reason = "killed"
    async with _client(app) as client:
        text = (await client.get("/metrics")).text
        health = await client.get("/health")
    assert health.status_code == 503
    for name in ("bladellm_num_requests_running", "bladellm_num_requests_waiting",
                 "bladellm_kv_cache_used_blocks", "bladellm_kv_cache_usage_ratio"):
        assert f"{name} 0.0" in text, name


async def test_engine_death_triggers_exit_after_a_drain():
    from bladellm.entrypoints.openai.lifecycle import watch_engine

    engine = FakeAsyncLLM()
    app = build_app(engine, ServerConfig())
    exited = asyncio.Event()
    watcher = asyncio.ensure_future(watch_engine(engine, app.state.lifecycle, 1.0,
                                                 exited.set))
    await asyncio.sleep(0.3)
    assert not exited.is_set()
    engine.dead_reason = "engine core process exited (exit code -9)"
    await asyncio.wait_for(exited.wait(), timeout=3)
    await watcher


async def test_server_chat_template_flag_replaces_the_tokenizers(engine, make_client):
    async with make_client(engine, chat_template="{{ messages[0].content }}") as client:
        r = await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200
    assert engine.input_processor.last_kwargs["chat_template"] == "{{ messages[0].content }}"
