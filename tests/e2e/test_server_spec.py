"""The OpenAI server with --decode_algo sps and look_ahead: streaming chat, usage equal to the
tokens actually emitted, greedy text equal to normal decoding's, acceptance in /metrics."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from test_server import API_KEY, ServerProcess, _metric

MESSAGES = [{"role": "user", "content": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16"}]


def _serve(model: str, *extra: str) -> ServerProcess:
    srv = ServerProcess([
        "--model", model, "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", "0",
        "--dtype", "float32", "--max_model_len", "256", "--num_kv_blocks", "256",
        "--api_key", API_KEY, "--disable_access_log", "--shutdown_timeout", "5",
        "--num_threads", "1", *extra])
    srv.wait_ready(timeout=240)
    return srv


async def _stream_chat(url: str) -> tuple[str, int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    tok = await client.completions.create(model="tiny", prompt="x", max_tokens=1)
    del tok
    return text, usage.completion_tokens


@pytest.mark.parametrize("algo", ["sps", "look_ahead"])
async def test_streaming_chat_with_speculation(tiny_model_factory, algo):
    model = tiny_model_factory("llama")
    results = {}
    for name, extra in (("normal", ()), (algo, ("--decode_algo", algo) + (
            ("--draft.model", model, "--gamma", "3") if algo == "sps" else ()))):
        srv = _serve(model, *extra)
        try:
            text, completion_tokens = await _stream_chat(srv.url)
            async with httpx.AsyncClient(base_url=srv.url) as http:
                metrics = (await http.get("/metrics")).text
            results[name] = (text, completion_tokens, metrics)
        finally:
            srv.proc.send_signal(signal.SIGTERM)
            srv.proc.wait(timeout=60)
    text, completion_tokens, metrics = results[algo]
    assert (text, completion_tokens) == results["normal"][:2]
    assert 0 < completion_tokens <= 40
    drafted = _metric(metrics, "bladellm_spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "bladellm_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    if algo == "sps":  # the target as its own draft accepts everything
        assert accepted == drafted
