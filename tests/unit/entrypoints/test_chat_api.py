"""/v1/chat/completions against the fake engine."""

import openai
from fake_engine import FakeAsyncLLM
from sse_helpers import sse_events
from tiny_models import train_tokenizer

from bladellm.engine.messages import EngineCoreOutput, Logprobs
from bladellm.engine.output_processor import OutputProcessor


def _msgs(*texts):
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


async def test_non_streaming_shape(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": _msgs("hi"), "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage",
                         "system_fingerprint"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": "abc", "refusal": None},
        "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    # The template's output is tokenized without extra special tokens (no BOS id 0 here).
    prompt = engine.calls[-1][0]
    assert prompt == [ord(c) for c in "<user>hi<assistant>"]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3,
                             "total_tokens": len(prompt) + 3,
                             "prompt_tokens_details": {"cached_tokens": 1}}


async def test_multi_turn_and_generation_prompt_flags(client, engine):
    msgs = [{"role": "system", "content": "be brief"}] + _msgs("q1", "a1", "q2")
    await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    text = "".join(chr(i) for i in engine.calls[-1][0])
    assert text == "<system>be brief<user>q1<assistant>a1<user>q2<assistant>"
    await client.post("/v1/chat/completions", json={
        "messages": _msgs("q1", "partial"), "max_tokens": 1, "add_generation_prompt": False,
        "continue_final_message": True})
    assert "".join(chr(i) for i in engine.calls[-1][0]) == "<user>q1<assistant>partial"
    assert engine.input_processor.last_kwargs == {"continue_final_message": True}
    # Content as a list of text parts; "developer" is the system role.
    await client.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "x"},
                                     {"type": "text", "text": "y"}]}]})
    assert "".join(chr(i) for i in engine.calls[-1][0]) == "<system>d<user>x\ny<assistant>"


async def test_max_completion_tokens_wins_and_chat_default_is_unbounded(client, engine):
    await client.post("/v1/chat/completions", json={
        "messages": _msgs("x"), "max_tokens": 5, "max_completion_tokens": 2})
    assert engine.calls[-1][1].max_tokens == 2
    await client.post("/v1/chat/completions", json={"messages": _msgs("x"), "ignore_eos": True})
    assert engine.calls[-1][1].max_tokens is None


async def test_streaming_chunks(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": _msgs("hi"), "max_tokens": 3, "stream": True, "n": 2})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices", "system_fingerprint"}
        assert c["object"] == "chat.completion.chunk"
        assert set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason",
                                        "stop_reason"}
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    texts = {0: "", 1: ""}
    for c in chunks[2:]:
        assert "role" not in c["choices"][0]["delta"]
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content", "")
    assert texts == {0: "abc", 1: "bcd"}
    assert sorted(c["choices"][0]["finish_reason"] for c in chunks
                  if c["choices"][0]["finish_reason"]) == ["length", "length"]


async def test_stream_usage_chunk(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": _msgs("hi"), "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(r)
    *chunks, last = events[:-1]
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


async def test_continuous_usage_stats(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": _msgs("hi"), "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = sse_events(r)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert counts == [1, 2, 3] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_logprobs_and_top_logprobs(client):
    r = await client.post("/v1/chat/completions", json={
        "messages": _msgs("hi"), "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -1.0, "bytes": [97]},
        {"token": "b", "logprob": -2.0, "bytes": [98]}]}
    assert len(content) == 2
    r = await client.post("/v1/chat/completions", json={
        "messages": _msgs("hi"), "max_tokens": 2, "logprobs": True, "stream": True})
    chunks = [c for c in sse_events(r)[:-1] if c["choices"][0]["logprobs"]]
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks] == ["a", "b"]
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []



class SplitCharacterEngine(FakeAsyncLLM):
    """Generates TEXT's tokens with a real byte-level BPE tokenizer and OutputProcessor: the
    emoji and CJK characters come out as several tokens that decode alone to U+FFFD."""

    TEXT = "😀🎉🔥 你好"

    def __init__(self):
        super().__init__()
        self.tok = train_tokenizer()
        self.ids = self.tok(self.TEXT, add_special_tokens=False).input_ids

    async def generate(self, prompt, params, request_id, *, delta=True):
        proc = OutputProcessor(self.tok)
        proc.add_request(request_id, None, [0], params, [request_id], arrival_time=0.0,
                         delta=delta)
        for step, tid in enumerate(self.ids):
            other = self.ids[(step + 1) % len(self.ids)]
            lp = Logprobs(token_ids=[[tid, tid, other]], logprobs=[[-0.5, -0.5, -1.5]],
                          ranks=[1])
            last = step == len(self.ids) - 1
            res = proc.process_outputs([EngineCoreOutput(
                request_id=request_id, new_token_ids=[tid], new_logprobs=lp,
                finish_reason="length" if last else None)], 1.0 + step)
            if request_id in res.request_outputs:
                yield res.request_outputs[request_id]


async def test_logprob_bytes_are_the_tokens_raw_bytes(make_client):
    engine = SplitCharacterEngine()
    text = SplitCharacterEngine.TEXT
    body = {"messages": _msgs("hi"), "logprobs": True, "top_logprobs": 2, "max_tokens": 20}
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json=body)
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == text
        content = choice["logprobs"]["content"]
        assert len(content) == len(engine.ids) > len(text)
        assert any(c["token"] == "\ufffd" for c in content)  # the token string stays decoded
        assert bytes(b for c in content for b in c["bytes"]) == text.encode("utf-8")
        for c in content:
            assert c["top_logprobs"][0]["bytes"] == c["bytes"]
        assert [c["bytes"] for c in content[1:]] == [c["top_logprobs"][1]["bytes"]
                                                     for c in content[:-1]]
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        streamed = [e for c in sse_events(r)[:-1] if c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]
        assert bytes(b for e in streamed for b in e["bytes"]) == text.encode("utf-8")


async def test_official_client(engine, make_client):
    async with make_client(engine) as http:
        client = openai.AsyncOpenAI(api_key="x", base_url="http://testserver/v1",
                                    http_client=http)
        resp = await client.chat.completions.create(model="fake-model", messages=_msgs("hi"),
                                                    max_tokens=3)
        assert resp.choices[0].message.content == "abc"
        assert resp.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(model="fake-model", messages=_msgs("hi"),
                                                      max_tokens=3, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream]
        assert "".join(parts) == "abc"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
