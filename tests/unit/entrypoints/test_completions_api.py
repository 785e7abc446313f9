"""/v1/completions against the fake engine: response shapes, streaming, sampling parameters."""

import openai
import pytest
from fake_engine import FakeTokenizer
from sse_helpers import sse_events


async def test_non_streaming_shape_and_usage(client, engine):
    r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello",
                                                   "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage",
                         "system_fingerprint"}
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "abcde", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None,
                                "prompt_logprobs": None}]
    prompt_tokens = len(engine.model_info.tokenizer.encode("hello"))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == prompt_tokens + 5


async def test_default_max_tokens_is_16_and_model_optional(client):
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16


async def test_list_of_prompts_token_ids_and_n(client, engine):
    r = await client.post("/v1/completions", json={"prompt": ["a", "bb"], "n": 2,
                                                   "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abc", "bcd", "abc", "bcd"]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == 2 + 3  # "a" and "bb", each with a BOS
    r = await client.post("/v1/completions", json={"prompt": [[65, 66], [67]],
                                                   "max_tokens": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["ab", "ab"]
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = await client.post("/v1/completions", json={"prompt": [65, 66, 67], "max_tokens": 2})
    assert r.status_code == 200 and engine.calls[-1][0] == [65, 66, 67]


async def test_echo(client):
    r = await client.post("/v1/completions", json={"prompt": "Say:", "echo": True,
                                                   "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "Say:ab"
    r = await client.post("/v1/completions", json={"prompt": [72, 105], "echo": True,
                                                   "max_tokens": 2, "stream": True})
    texts = [e["choices"][0]["text"] for e in sse_events(r)[:-1]]
    assert "".join(texts) == "Hiab" and texts[0] == "Hia"


async def test_streaming_chunks(client):
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2,
                                                   "stream": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "system_fingerprint"}
        assert c["object"] == "text_completion"
        assert len(c["choices"]) == 1
        assert set(c["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                        "stop_reason", "prompt_logprobs"}
    assert len({c["id"] for c in chunks}) == 1
    by_index = {0: "", 1: ""}
    for c in chunks:
        by_index[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert by_index == {0: "abc", 1: "bcd"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]


async def test_stream_include_usage(client):
    r = await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["prompt_tokens"] == 2
    assert usage_chunk["usage"]["total_tokens"] == 6


async def test_logprobs_shape(client):
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                   "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"] == [-1.0, -2.0, -3.0]
    # The sampled token is always there, even outside the top-2 (OpenAI, vLLM: up to
    # logprobs + 1 entries).
    assert lp["top_logprobs"] == [{"a": -1.0, "b": -2.0}] * 2 + [{"a": -1.0, "b": -2.0,
                                                                   "c": -3.0}]
    assert lp["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True])
async def test_top_logprobs_always_hold_the_sampled_token(client, stream):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                   "logprobs": 2, "stream": stream})
    if stream:
        lps = [c["choices"][0]["logprobs"] for c in sse_events(r)[:-1]]
        tops = [t for lp in lps for t in lp["top_logprobs"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        tops, tokens = lp["top_logprobs"], lp["tokens"]
    assert tokens == ["a", "b", "c", "d"]
    for token, top in zip(tokens, tops):
        assert token in top and 2 <= len(top) <= 3
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                   "logprobs": 0})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -1.0}, {"b": -2.0}]


def test_echo_top_logprobs_hold_the_prompt_token():
    from bladellm.entrypoints.openai.prompt_logprobs import echo_logprobs
    from bladellm.outputs import TokenLogprob

    ctx = type("Ctx", (), {"tokenizer": FakeTokenizer()})()
    # Prompt "xyz": "y" is in the top-1, "z" is not.
    entries = [[TokenLogprob(ord("y"), -0.1, 1, "y"), TokenLogprob(ord("y"), -0.1, 1, "y")],
               [TokenLogprob(ord("z"), -4.0, 7, "z"), TokenLogprob(ord("q"), -0.2, 1, "q")]]
    lp = echo_logprobs([ord("x"), ord("y"), ord("z")], entries, ctx, 1)
    assert lp.tokens == ["x", "y", "z"] and lp.token_logprobs == [None, -0.1, -4.0]
    assert lp.top_logprobs == [None, {"y": -0.1}, {"q": -0.2, "z": -4.0}]
    assert echo_logprobs([ord("x"), ord("z")], entries[1:], ctx, 0).top_logprobs == [
        None, {"z": -4.0}]


async def test_sampling_fields_reach_the_engine(client, engine):
    await client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 3, "temperature": 0.2, "top_p": 0.9, "seed": 7,
        "stop": "zz", "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {"65": 5.0}, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
        "ignore_eos": True, "stop_token_ids": [7], "min_tokens": 2})
    params = engine.calls[-1][1]
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.2, 0.9, 7, ["zz"])
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {65: 5.0}
    assert (params.top_k, params.min_p, params.repetition_penalty) == (3, 0.1, 1.2)
    assert params.ignore_eos and params.stop_token_ids == [7] and params.min_tokens == 2


async def test_unset_fields_take_generation_config_defaults(client, engine):
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    params = engine.calls[-1][1]
    assert params.temperature == 0.7 and params.top_k == 20  # from the model
    assert params.top_p == 1.0 and params.repetition_penalty == 1.0  # the model sets none


async def test_finish_reason_stop(client, engine):
    engine.eos_after_tokens = 2
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert r.json()["choices"][0] == {"index": 0, "text": "ab", "logprobs": None,
                                      "finish_reason": "stop", "stop_reason": None,
                                      "prompt_logprobs": None}


async def test_official_client_parses_responses(engine, make_client):
    async with make_client(engine) as http:
        client = openai.AsyncOpenAI(api_key="x", base_url="http://testserver/v1",
                                    http_client=http)
        resp = await client.completions.create(model="fake-model", prompt="hi", max_tokens=4)
        assert resp.choices[0].text == "abcd" and resp.usage.completion_tokens == 4
        stream = await client.completions.create(model="fake-model", prompt="hi", max_tokens=4,
                                                 stream=True,
                                                 stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        assert text == "abcd" and usage.completion_tokens == 4


@pytest.mark.parametrize("n", [1, 3])
async def test_stream_and_non_stream_agree(client, n):
    body = {"prompt": "x", "max_tokens": 6, "n": n}
    full = (await client.post("/v1/completions", json=body)).json()
    events = sse_events(await client.post("/v1/completions", json={**body, "stream": True}))
    texts = [""] * n
    for c in events[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == [c["text"] for c in full["choices"]]
