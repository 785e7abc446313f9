"""``blade_llm_server`` end to end: the real server process on 127.0.0.1 with a tiny model,
driven by the official ``openai`` client (and httpx where the client hides the wire).

One server for the whole module (start-up dominates the run time); the last test stops it with
SIGTERM and checks that nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

API_KEY = "e2e-key"
# Long enough that a max_tokens ~ MAX_MODEL_LEN stream cannot finish during the few round trips
# the disconnect tests make, even on a slow, loaded CI machine (the tiny model's default
# context is 512: the fixture's model has 1024 positions).
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
READY = re.compile(r"ready at (http://[\d.]+:(\d+))")


class ServerProcess:
    """The server subprocess; a thread drains its output so that it never blocks on a pipe."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bladellm.entrypoints.cli.server", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = READY.search(line)
            if match and not self.ready.is_set():
                self.url, self.port = match.group(1), int(match.group(2))
                self.ready.set()
        self.ready.set()  # exited: wake up the waiter

    def wait_ready(self, timeout: float) -> str:
        if not self.ready.wait(timeout) or self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not become ready:\n" + "".join(self.lines[-50:]))
        return self.url

    def log(self) -> str:
        return "".join(self.lines)


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc; no psutil needed)."""
    result = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            result.append(int(entry))
    return result


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    model = tiny_model_factory("llama", max_position_embeddings=MAX_MODEL_LEN)
    srv = ServerProcess([
        "--model", model, "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", "0",
        "--dtype", "float32", "--max_model_len", str(MAX_MODEL_LEN), "--num_kv_blocks", "1024",
        "--block_size", str(BLOCK_SIZE), "--api_key", API_KEY,
        "--max_request_body_bytes", "64KiB", "--disable_access_log", "--shutdown_timeout", "5",
        "--num_threads", "1"])
    srv.wait_ready(timeout=240)
    yield srv
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.proc.kill()


@pytest.fixture
def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                              timeout=60)


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def _metrics(server) -> str:
    async with httpx.AsyncClient() as http:
        r = await http.get(server.url + "/metrics")
    assert r.status_code == 200
    return r.text


# ------------------------------------------------------------------------------ happy paths


async def test_completions(client):
    resp = await client.completions.create(model="tiny", prompt="The quick brown fox",
                                           max_tokens=8, temperature=0, extra_body={
                                               "ignore_eos": True})
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    # Streaming gives the same greedy text, and the usage chunk when asked.
    stream = await client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        usage = chunk.usage or usage
    assert text == resp.choices[0].text
    assert usage.completion_tokens == 8 and usage.prompt_tokens == resp.usage.prompt_tokens


async def test_completions_batch_echo_and_token_ids(client):
    resp = await client.completions.create(model="tiny", prompt=["Paris is", "Berlin is"], n=2,
                                           max_tokens=4, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 16
    resp = await client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]],
                                           max_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 4
    resp = await client.completions.create(model="tiny", prompt="Paris is", echo=True,
                                           max_tokens=3, temperature=0)
    assert resp.choices[0].text.startswith("Paris is")


async def test_chat(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "how are you?"}]
    resp = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 6
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                  temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_health_version(server, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/version")).json()["version"]


async def test_64_concurrent_streams(client):
    async def one(i: int) -> tuple[int, int, int]:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"count to {i}"}],
            max_tokens=12, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finished, usage = 0, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finished += 1
            usage = chunk.usage or usage
        return finished, usage.completion_tokens, usage.total_tokens - usage.prompt_tokens

    results = await asyncio.gather(*(one(i) for i in range(64)))
    assert results == [(1, 12, 12)] * 64


async def test_disconnect_mid_stream_frees_kv_blocks(server):
    """Close the stream at its first token. No in-stream /metrics round trip: on a loaded
    machine the stream could finish during it. That the request held KV blocks when it was
    cut is implied by the abort (+1) and by fewer than max_tokens tokens reaching the API."""
    before = await _metrics(server)
    aborted_before = _metric(before, 'bladellm_request_success_total{finished_reason="abort"}')
    tokens_before = _metric(before, "bladellm_generation_tokens_total")
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
        # Leaving the block closed the connection mid-stream, right after the first token.
    deadline = time.monotonic() + 20
    peak = 0.0
    while True:
        after = await _metrics(server)
        peak = max(peak, _metric(after, "bladellm_kv_cache_used_blocks"))
        if _metric(after, "bladellm_kv_cache_used_blocks") == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert _metric(after, "bladellm_kv_cache_used_blocks") == 0
    assert _metric(after, 'bladellm_request_success_total{finished_reason="abort"}') \
        == aborted_before + 1
    assert _metric(after, "bladellm_generation_tokens_total") - tokens_before < max_tokens
    _assert_stopped_in_the_core(peak, max_tokens)


def _assert_stopped_in_the_core(peak_blocks: float, max_tokens: int) -> None:
    """The API forgets an aborted request at once (its token counter stops), so blocks that
    reach 0 could also mean the core ran it to its end. While polling until they do, the
    request never held the blocks of half its tokens: the core stopped it early."""
    assert peak_blocks * BLOCK_SIZE < max_tokens // 2, \
        f"the core kept running the aborted request (up to {peak_blocks:.0f} blocks)"


async def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    before = await _metrics(server)
    aborted_before = _metric(before, 'bladellm_request_success_total{finished_reason="abort"}')
    tokens_before = _metric(before, "bladellm_generation_tokens_total")
    max_tokens = MAX_MODEL_LEN - 32
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()

    async with httpx.AsyncClient(base_url=server.url) as http:  # one client for every poll
        async def metrics() -> str:
            r = await http.get("/metrics")
            assert r.status_code == 200
            return r.text

        deadline = time.monotonic() + 20
        while _metric(await metrics(), "bladellm_num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never started"
            await asyncio.sleep(0.01)
        writer.close()  # the client gives up before the response
        await writer.wait_closed()
        # The stats snapshot that comes with the abort may predate the core's processing of
        # the abort (blocks still held): wait for both.
        deadline = time.monotonic() + 20
        peak = 0.0
        while True:
            after = await metrics()
            peak = max(peak, _metric(after, "bladellm_kv_cache_used_blocks"))
            if ((_metric(after, 'bladellm_request_success_total{finished_reason="abort"}')
                    > aborted_before and _metric(after, "bladellm_kv_cache_used_blocks") == 0)
                    or time.monotonic() > deadline):
                break
            await asyncio.sleep(0.01)
    assert _metric(after, 'bladellm_request_success_total{finished_reason="abort"}') \
        == aborted_before + 1
    assert _metric(after, "bladellm_kv_cache_used_blocks") == 0
    assert _metric(after, "bladellm_generation_tokens_total") - tokens_before < max_tokens
    _assert_stopped_in_the_core(peak, max_tokens)


# ------------------------------------------------------- vLLM extras (issue 15, item 7)


async def test_metrics_split_the_steps_by_phase(server, client):
    """Every phase of a served step is timed and published; the runner's phases add up to
    less than the steps' wall time, the front end's output work is counted too."""
    before = await _metrics(server)
    await client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                    extra_body={"ignore_eos": True})
    after = await _metrics(server)
    steps = (_metric(after, "bladellm_engine_steps_total")
             - _metric(before, "bladellm_engine_steps_total"))
    assert steps >= 8  # a prefill, then a decode step per further token (and other tests')
    grew = {}
    for phase in ("recv", "schedule", "prepare", "forward", "logits", "sample", "executor",
                  "update", "send"):
        name = f'bladellm_engine_step_phase_seconds_total{{phase="{phase}"}}'
        grew[phase] = _metric(after, name) - _metric(before, name)
    # The send of a step is reported with the next step's stats: at least the prefill's.
    assert all(grew[p] > 0 for p in ("recv", "schedule", "prepare", "forward", "logits",
                                     "sample", "update", "send")), grew
    assert grew["executor"] >= 0
    assert (_metric(after, "bladellm_api_output_processing_seconds_total")
            > _metric(before, "bladellm_api_output_processing_seconds_total"))
    assert _metric(after, "process_cpu_seconds_total") > 0


async def test_tokenize_and_detokenize_match_the_engine(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    msgs = [{"role": "user", "content": "hello"}]
    resp = await client.completions.create(model="tiny", prompt="The quick brown fox",
                                           max_tokens=1)
    chat = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
        r = await http.post("/tokenize", json={"model": "tiny", "prompt": "The quick brown fox",
                                               "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) == resp.usage.prompt_tokens
        assert body["max_model_len"] == MAX_MODEL_LEN and len(body["token_strs"]) == body["count"]
        r = await http.post("/tokenize", json={"messages": msgs})
        assert r.json()["count"] == chat.usage.prompt_tokens
        ids = body["tokens"]
        r = await http.post("/detokenize", json={"model": "tiny", "tokens": ids})
        assert r.status_code == 200 and r.json()["prompt"].endswith("The quick brown fox")
        r = await http.post("/detokenize", json={"tokens": [10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await http.post("/tokenize", json={"prompt": "x", "messages": msgs})
        assert r.status_code == 400
        r = await http.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "no"})
        assert r.status_code == 401


async def test_stop_reason_in_choices(client):
    greedy = await client.completions.create(model="tiny", prompt="Paris is", max_tokens=6,
                                             temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    assert greedy.choices[0].model_extra["stop_reason"] is None
    stop = text[2:4]
    resp = await client.completions.create(model="tiny", prompt="Paris is", max_tokens=6,
                                           temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == stop
    tok = (await client.completions.create(model="tiny", prompt="Paris is", max_tokens=1,
                                           temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True}))
    first = tok.choices[0].text
    async with httpx.AsyncClient(base_url=client.base_url.__str__().removesuffix("/v1/"),
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        ids = (await http.post("/tokenize", json={"prompt": first,
                                                  "add_special_tokens": False})).json()["tokens"]
    msgs = [{"role": "user", "content": "hi"}]
    full = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
    chat_stop = full.choices[0].message.content[2:4]
    chat = await client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True, stop=[chat_stop],
        extra_body={"ignore_eos": True})
    chunks = [c async for c in chat]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_reason"] == chat_stop
    resp = await client.completions.create(model="tiny", prompt="Paris is", max_tokens=6,
                                           temperature=0, extra_body={
                                               "ignore_eos": True, "stop_token_ids": ids[:1]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == ids[0]


async def test_embeddings_with_the_official_client(server, client):
    import math

    texts = ["The quick brown fox", "Paris is the capital of France"]
    resp = await client.embeddings.create(model="tiny", input=texts)  # base64 on the wire
    assert [d.index for d in resp.data] == [0, 1] and resp.model == "tiny"
    vecs = [d.embedding for d in resp.data]
    assert all(len(v) == 64 and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vecs)
    assert vecs[0] != vecs[1]
    floats = await client.embeddings.create(model="tiny", input=texts[0],
                                            encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vecs[0], abs=1e-6)
    ids = await client.embeddings.create(model="tiny", input=[[5, 6, 7], [8, 9]])
    assert ids.usage.prompt_tokens == 5 == ids.usage.total_tokens
    assert resp.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        await client.embeddings.create(model="tiny", input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.embeddings.create(model="tiny", input=[[5] * (MAX_MODEL_LEN + 1)])
    # vLLM's truncate_prompt_tokens (its benchmark client sends -1): keep the last k tokens.
    long = [5 + i % 50 for i in range(MAX_MODEL_LEN + 7)]
    cut = await client.embeddings.create(model="tiny", input=[long],
                                         extra_body={"truncate_prompt_tokens": -1})
    tail = await client.embeddings.create(model="tiny", input=[long[-MAX_MODEL_LEN:]])
    assert cut.usage.prompt_tokens == MAX_MODEL_LEN
    assert cut.data[0].embedding == pytest.approx(tail.data[0].embedding, abs=1e-6)
    three = await client.embeddings.create(model="tiny", input=[[9, 8, 7, 6, 5]],
                                           extra_body={"truncate_prompt_tokens": 3})
    assert three.usage.prompt_tokens == 3
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            await client.embeddings.create(model="tiny", input="x",
                                           extra_body={"truncate_prompt_tokens": bad})


async def test_prompt_logprobs_and_echo_with_logprobs(server, client):
    import math

    prompt = "The quick brown fox jumps"
    resp = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    choice = resp.choices[0]
    plp = choice.model_extra["prompt_logprobs"]
    n_prompt = resp.usage.prompt_tokens
    assert len(plp) == n_prompt and plp[0] is None
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
    # The top-2 plus the token itself when it is not among them (OpenAI, vLLM).
    assert all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert choice.text.startswith(prompt)
    # Each prompt token's logprob: the one vLLM's field reports for it, <= 0, rank >= 1.
    tok = (await httpx.AsyncClient(base_url=server.url, headers={
        "Authorization": f"Bearer {API_KEY}"}).post("/tokenize", json={"prompt": prompt})).json()
    for pos in range(1, n_prompt):
        entry = plp[pos][str(tok["tokens"][pos])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[pos], abs=1e-5)
        assert entry["logprob"] <= 0 and entry["rank"] >= 1
    assert sum(math.exp(v) for v in lp.top_logprobs[1].values()) <= 1.0 + 1e-6
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
        stream=True, extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == plp
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == n_prompt + 3
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "x"}], extra_body={"prompt_logprobs": 1})


# ----------------------------------------------------------------------------------- errors


async def test_errors_and_the_server_keeps_serving(server, client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (openai.BadRequestError, dict(prompt="x", max_tokens=-1)),
        (openai.BadRequestError, dict(prompt="x", max_tokens=10**9)),
        (openai.BadRequestError, dict(prompt="hello " * 200, max_tokens=900)),
        (openai.BadRequestError, dict(prompt="x", temperature="hot")),
        (openai.BadRequestError, dict(prompt="x", extra_body={"guided_json": {"type": "foo"}})),
        (openai.BadRequestError, dict(prompt="x", extra_body={"prompt_logprobs": 21})),
        (openai.BadRequestError, dict(prompt="x", suffix="y")),
        (openai.NotFoundError, dict(prompt="x", model="gpt-4")),
    ]
    for exc_type, kwargs in cases:
        with pytest.raises(exc_type) as info:
            await client.completions.create(**{"model": "tiny", **kwargs})
        err = info.value.body
        assert set(err) == {"message", "type", "param", "code"}, err
    with pytest.raises(openai.BadRequestError, match="at least one"):
        await client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="not among"):
        await client.chat.completions.create(model="tiny", messages=msgs, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}})
    bad_key = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad_key.chat.completions.create(model="tiny", messages=msgs)
    async with httpx.AsyncClient(base_url=server.url,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        r = await http.post("/v1/completions", json={"prompt": "x" * 70_000})
        assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param",
                                                                   "code"}
        r = await http.post("/v1/completions", content=b"{broken",
                            headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    resp = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3,
                                                extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3


# ------------------------------------------------------------------------------- shutdown


def test_sigterm_shuts_down_cleanly(server):
    """Last test of the module: SIGTERM with a stream in flight; it completes or fails
    promptly, the engine process exits, the port is released, nothing is left behind."""
    children = _children(server.proc.pid)
    assert children, "the engine core should run in a child process"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = []
            try:
                rest = [line for line in lines if line]
            except httpx.HTTPError:
                pass  # failed in-flight requests are acceptable; hanging ones are not
    if rest:
        assert rest[-1] == "data: [DONE]"
    assert server.proc.wait(timeout=30) == 0
    # multiprocessing's resource tracker exits when it sees the server's end of its pipe close,
    # a moment after the server itself: allow it a few seconds.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in children if _alive(pid)]
    assert not left, [_cmdline(pid) for pid in left]
    with socket.socket() as sock:  # the port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
    assert "server stopped" in server.log()
    assert "Traceback" not in server.log(), server.log()[-3000:]


@pytest.mark.parametrize("case", ["port_taken", "bad_model", "bad_quantization"])
def test_failed_start_leaves_no_engine_behind(tiny_model_factory, tmp_path, case):
    """The engine core is started before the HTTP stack is imported; a start that fails after
    that (port taken, model unreadable, a --quantization the checkpoint does not have: the
    engine core checks it, the API process never imports torch) must still exit 1 with the
    reason, without a traceback, and stop the core."""
    model = tiny_model_factory("llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if case == "port_taken" else 0
        if case == "bad_model":
            model = str(tmp_path / "no-such-model")
        quant = ["--quantization", "gptq"] if case == "bad_quantization" else []
        srv = ServerProcess(["--model", model, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--num_threads", "1", *quant])
        children: set[int] = set()
        deadline = time.monotonic() + 120
        while srv.proc.poll() is None and time.monotonic() < deadline:
            children.update(_children(srv.proc.pid))  # the engine core, while it lives
            time.sleep(0.05)
        assert srv.proc.wait(timeout=5) == 1
        # A missing model path is not started early (it may be a hub id to fetch first).
        assert children or case == "bad_model", "the engine core was never started"
    expected = {"port_taken": "cannot listen", "bad_model": "no-such-model",
                "bad_quantization": "--quantization gptq: the checkpoint's config.json has no "
                                    "quantization_config"}[case]
    assert expected in srv.log(), srv.log()
    assert "Traceback" not in srv.log()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [_cmdline(pid) for pid in children if _alive(pid)]
