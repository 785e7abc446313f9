"""Every error leaves as an OpenAI error body with the right status, and the server keeps
serving afterwards."""

import asyncio
import json

import httpx
import pytest
from sse_helpers import sse_events

from bladellm.errors import EngineOverloadedError, RequestFailedError

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "ANY", words: str = ""):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param != "ANY":
        assert body["error"]["param"] == param
    assert words.lower() in body["error"]["message"].lower()
    return body["error"]


async def assert_still_serving(client):
    r = await client.post(CMPL, json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


@pytest.mark.parametrize("path,body,param,words", [
    (CMPL, {"prompt": "x", "max_tokens": -1}, "max_tokens", ">= 1"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens", ""),
    (CMPL, {"prompt": "x", "max_tokens": 10**30}, "max_tokens", "less than or equal to 2147483647"),
    (CMPL, {"prompt": "x" * 120, "max_tokens": 20}, "max_tokens", "context length"),
    (CMPL, {"prompt": "x", "max_tokens": "many"}, "max_tokens", "integer"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, "temperature", ""),
    (CMPL, {"prompt": "x", "temperature": -1}, "temperature", ""),
    (CMPL, {"prompt": "x", "top_p": 0}, "top_p", ""),
    (CMPL, {"prompt": "x", "n": 0}, "n", ""),
    (CMPL, {"prompt": "x", "presence_penalty": 5}, "presence_penalty", ""),
    (CMPL, {"prompt": "x", "logprobs": 50}, "logprobs", ""),
    (CMPL, {"prompt": "x", "stop": ["a", ""]}, "stop", ""),
    (CMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", ""),
    (CMPL, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "out of range"),
    (CMPL, {"prompt": []}, "prompt", "empty"),
    (CMPL, {"prompt": 5}, "prompt", "invalid type"),
    (CMPL, {"prompt": ["a", 1]}, "prompt", "invalid type"),
    (CMPL, {"prompt": [[]]}, "prompt", "empty"),
    (CMPL, {"prompt": [1, 99999]}, "prompt", "out of range"),
    (CMPL, {"max_tokens": 3}, "prompt", "missing"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", ""),
    (CMPL, {"prompt": "x", "not_a_field": 1}, "not_a_field", "unrecognized"),
    (CHAT, {"messages": []}, "messages", "at least one"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", ""),
    (CHAT, {"messages": "hi"}, "messages", ""),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ""),
])
async def test_invalid_values_are_400(client, path, body, param, words):
    err = assert_error(await client.post(path, json=body), 400, param, words)
    assert err["type"] == "invalid_request_error"
    await assert_still_serving(client)


EMB = "/v1/embeddings"


@pytest.mark.parametrize("path,body,param,words,code", [
    # The fake's context is 128 tokens; a completions prompt gets a BOS, a chat one
    # "<user>...<assistant>" (17 tokens) around the content.
    (CMPL, {"prompt": "x" * 120, "max_tokens": 20}, "max_tokens", "prompt (121 tokens) + "
     "max_tokens (20)", "context_length_exceeded"),
    (CMPL, {"prompt": "x" * 127, "max_tokens": 1}, "prompt", "context length",
     "context_length_exceeded"),
    (CMPL, {"prompt": ["ok", "x" * 127], "max_tokens": 1}, "prompt", "context length",
     "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 20},
     "max_tokens", "messages (117 tokens) + max_tokens (20)", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 100}], "max_completion_tokens": 20,
            "stream": True}, "max_completion_tokens",
     "messages (117 tokens) + max_completion_tokens (20)", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 120}]}, "messages",
     "leaves no room", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 120}], "max_tokens": 5}, "messages",
     "context length", "context_length_exceeded"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens: must be >= 1, got 0", None),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 10**6}, "max_completion_tokens",
     "max_completion_tokens: 1000000 exceeds", None),
    (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens", "max_tokens: must be >= 1", None),
    (CHAT, {"messages": [{"role": "function", "name": "f", "content": "42"}]},
     "messages[0].role", "'function' role", "unsupported_parameter"),
    (CHAT, {"messages": [MSGS[0], {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text"}]}]},
     "messages[1].content[1]", "must have a 'text' string", "missing_required_parameter"),
    (EMB, {"input": ""}, "input", "input: must not be empty", None),
    (EMB, {"input": []}, "input", "input: must not be empty", None),
    (EMB, {"input": ["a", ""]}, "input", "input[1]: must not be empty", None),
    (EMB, {"input": [[5], []]}, "input", "input[1]: must not be empty", None),
    (EMB, {"input": [[5] * 200]}, "input", "input[0]: 200 tokens exceed", None),
])
async def test_errors_name_the_field_the_client_sent(client, path, body, param, words, code):
    err = assert_error(await client.post(path, json=body), 400, param, words)
    assert err["code"] == code
    await assert_still_serving(client)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("path,extra,param,words", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    (CHAT, {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex",
     "guided_json and guided_regex"),
    (CHAT, {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
     "response_format", "only one"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}, "tool_choice", "only one"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "requires tools"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not among"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    (CHAT, {"tools": TOOLS + TOOLS}, "tools", "unique"),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages", "not valid JSON"),
    (CMPL, {"guided_choice": []}, "guided_choice", "non-empty"),
    (CMPL, {"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    (CMPL, {"guided_json": [1]}, "guided_json", "must be an object"),
    (CMPL, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
    (CMPL, {"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "JSON"),
    (CMPL, {"structured_outputs": {"xml": "a"}}, "structured_outputs", "unknown"),
])
async def test_bad_structured_output_is_400(client, engine, path, extra, param, words):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "x"}
    assert_error(await client.post(path, json={**base, **extra}), 400, param, words)
    assert engine.calls == []  # nothing reached the engine


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"guided_decoding_backend": "xgrammar", "guided_regex": "a"},
     "guided_decoding_backend"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"best_of": 2}, "best_of"),
    (CHAT, {"audio": {"voice": "x"}}, "audio"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    (CMPL, {"suffix": "tail"}, "suffix"),
    (CMPL, {"best_of": 3, "n": 1}, "best_of"),
    (CHAT, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (CMPL, {"use_beam_search": True}, "use_beam_search"),
])
async def test_unsupported_fields_are_400_naming_them(client, engine, path, extra, param):
    base = {"messages": MSGS} if path == CHAT else {"prompt": "x"}
    err = assert_error(await client.post(path, json={**base, **extra}), 400, param,
                       "not supported")
    assert err["code"] == "unsupported_parameter"
    assert engine.calls == []  # nothing reached the engine


async def test_harmless_fields_are_accepted(client):
    r = await client.post(CHAT, json={"messages": MSGS, "max_tokens": 1, "user": "u",
                                      "response_format": {"type": "text"}, "tool_choice": "none",
                                      "best_of": 1, "metadata": {"k": "v"}})
    assert r.status_code == 200


async def test_malformed_json_and_wrong_body_type(client):
    r = await client.post(CMPL, content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, words="json")
    assert_error(await client.post(CMPL, json=[1, 2]), 400)
    assert_error(await client.post(CMPL, content=b""), 400)
    await assert_still_serving(client)


async def test_unknown_model_is_404(client):
    for path, body in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": MSGS})):
        err = assert_error(await client.post(path, json={**body, "model": "gpt-4"}), 404,
                           "model", "does not exist")
        assert err["code"] == "model_not_found"
    assert_error(await client.get("/v1/models/gpt-4"), 404, "model")
    assert (await client.get("/v1/models/fake-model")).json()["id"] == "fake-model"
    assert_error(await client.get("/v1/no-such-route"), 404)


async def test_api_key(engine, make_client):
    async with make_client(engine, api_key="s3cret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            err = assert_error(await client.post(CMPL, json={"prompt": "x"}, headers=headers),
                               401)
            assert err["code"] == "invalid_api_key"
            assert_error(await client.get("/v1/models", headers=headers), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert (await client.post(CMPL, json={"prompt": "x"}, headers=ok)).status_code == 200
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        # Operational endpoints stay open for probes and scrapers.
        for path in ("/health", "/metrics", "/version"):
            assert (await client.get(path)).status_code == 200


async def test_overloaded_is_503_with_retry_after(client, engine):
    engine.raise_on_generate = EngineOverloadedError("queue full")
    for path, body in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": MSGS}),
                       (CMPL, {"prompt": "x", "stream": True})):
        r = await client.post(path, json=body)
        err = assert_error(r, 503, words="queue full")
        assert r.headers["retry-after"] == "1"
        assert err["type"] == "server_error"
    engine.raise_on_generate = None
    await assert_still_serving(client)


async def test_dead_engine_is_503_and_health_red(client, engine):
    assert (await client.get("/health")).status_code == 200
    engine.dead_reason = "core crashed"
    r = await client.post(CMPL, json={"prompt": "x"})
    assert_error(r, 503, words="core crashed")
    assert "retry-after" in r.headers
    assert_error(await client.get("/health"), 503, words="core crashed")


async def test_engine_error_is_500(client, engine):
    engine.raise_on_generate = RequestFailedError("kernel exploded")
    err = assert_error(await client.post(CMPL, json={"prompt": "x"}), 500, words="exploded")
    assert err["type"] == "server_error"
    engine.raise_on_generate = None
    engine.fail_after_tokens = 2  # the request fails after some output
    assert_error(await client.post(CHAT, json={"messages": MSGS}), 500, words="boom")
    engine.fail_after_tokens = None
    await assert_still_serving(client)


async def test_engine_error_mid_stream_is_an_error_event(client, engine):
    engine.fail_after_tokens = 2
    events = sse_events(await client.post(CHAT, json={"messages": MSGS, "stream": True}))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"].endswith("boom in the engine")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "ab"


async def test_body_over_limit_is_413(engine, make_client):
    async with make_client(engine, max_request_body_bytes="1KiB") as client:
        big = {"prompt": "x" * 2000}
        err = assert_error(await client.post(CMPL, json=big), 413)
        assert err["code"] == "request_too_large"

        async def chunked():  # no Content-Length: counted as it arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 256):
                yield data[i:i + 256]

        assert_error(await client.post(CMPL, content=chunked()), 413)
        await assert_still_serving(client)


async def test_internal_bug_is_500_not_a_crash(client, engine):
    engine.raise_on_generate = KeyError("oops")
    assert_error(await client.post(CMPL, json={"prompt": "x"}), 500)
    engine.raise_on_generate = None
    await assert_still_serving(client)


async def test_concurrent_bad_and_good_requests(client):
    bad = [client.post(CMPL, json={"prompt": "x", "max_tokens": -5}) for _ in range(10)]
    good = [client.post(CMPL, json={"prompt": "x", "max_tokens": 3}) for _ in range(10)]
    results = await asyncio.gather(*bad, *good)
    assert [r.status_code for r in results] == [400] * 10 + [200] * 10
