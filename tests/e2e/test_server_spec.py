"""The OpenAI server with --decode_algo sps and look_ahead: streaming chat, usage equal to the
tokens actually emitted, greedy tokens equal to normal decoding's (the offline engine, same
model), acceptance in /metrics. sps is marked slow (one more server start-up)."""

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


def _normal_output(model: str) -> tuple[str, list[int]]:
    from bladellm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=256)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    return out[0].outputs[0].text, out[0].outputs[0].token_ids


@pytest.mark.parametrize("algo", [pytest.param("sps", marks=pytest.mark.slow), "look_ahead"])
async def test_streaming_chat_with_speculation(tiny_model_factory, algo):
    model = tiny_model_factory("llama")
    expected_text, expected = _normal_output(model)
    extra = ("--decode_algo", algo)
    if algo == "sps":  # the cost rule would (rightly) never run a self-draft
        extra += ("--draft.model", model, "--gamma", "3", "--spec_policy", "always")
    srv = _serve(model, *extra)
    try:
        text, completion_tokens = await _stream_chat(srv.url)
        async with httpx.AsyncClient(base_url=srv.url) as http:
            metrics = (await http.get("/metrics")).text
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=60)
    assert completion_tokens == len(expected)
    assert text == expected_text
    drafted = _metric(metrics, "bladellm_spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "bladellm_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    if algo == "sps":  # the target as its own draft accepts everything
        assert accepted == drafted
