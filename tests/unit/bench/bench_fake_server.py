"""A fake OpenAI-compatible streaming server with known timings, run in a background thread.

Every streamed request waits ``ttft_s`` before its first token and ``itl_s`` between tokens,
emits ``max_tokens`` words, ``tokens_per_chunk`` per chunk (completions or chat), a usage chunk when
``stream_options.include_usage`` is set, then ``[DONE]``. A prompt containing ``FAIL_HTTP``
gets a 500; one containing ``FAIL_STREAM`` gets an error event after its first token.

With ``metrics=True`` it also serves ``/metrics`` (Prometheus text); with ``spec_per_request=
(drafts, draft_tokens, accepted_tokens)`` that page carries speculative-decoding counters, under
both vLLM's and BladeLLM's spellings as BladeLLM publishes them, grown by those amounts for every
completed stream before its ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from aiohttp import web


class FakeOpenAIServer:
    def __init__(self, ttft_s: float = 0.05, itl_s: float = 0.02, usage: bool = True,
                 model: str = "fake-model", metrics: bool = False,
                 spec_per_request: tuple[int, int, int] | None = None,
                 tokens_per_chunk: int = 1):
        self.ttft_s = ttft_s
        self.tokens_per_chunk = tokens_per_chunk  # >1: a chunk carries that many words
        self.metrics = metrics
        self.spec_per_request = spec_per_request
        self.spec_totals = [0, 0, 0]
        self.metrics_scrapes = 0
        self.itl_s = itl_s
        self.usage = usage
        self.model = model
        self.payloads: list[dict] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = _free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeOpenAIServer":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        if self.metrics:
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        lines = ["# HELP vllm:num_requests_running Requests running.",
                 "# TYPE vllm:num_requests_running gauge",
                 f'vllm:num_requests_running{{model_name="{self.model}"}} {self._in_flight}.0']
        if self.spec_per_request is not None:
            for (name, help_), total in zip(
                    (("spec_decode_num_drafts", "Drafts."),
                     ("spec_decode_num_draft_tokens", "Draft tokens."),
                     ("spec_decode_num_accepted_tokens", "Accepted tokens.")), self.spec_totals):
                for prefix, labels in (("vllm:", f'{{model_name="{self.model}"}}'),
                                       ("bladellm_", "")):
                    lines += [f"# HELP {prefix}{name}_total {help_}",
                              f"# TYPE {prefix}{name}_total counter",
                              f"{prefix}{name}_total{labels} {float(total)}",
                              f"{prefix}{name}_created{labels} 1.7e+09"]
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.payloads.append(body)
        is_chat = request.path.endswith("/chat/completions")
        prompt = (json.dumps(body["messages"]) if is_chat else body["prompt"])
        if "FAIL_HTTP" in prompt:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            return await self._stream(request, body, is_chat, prompt)
        finally:
            self._in_flight -= 1

    async def _stream(self, request, body, is_chat, prompt) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        if is_chat:  # a role-only first chunk, as real servers send: must not count as a token
            await _send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        t0 = time.perf_counter()
        for i in range(n):
            # Sleep to absolute deadlines so timer slack doesn't accumulate.
            target = t0 + self.ttft_s + i * self.itl_s
            await asyncio.sleep(max(0.0, target - time.perf_counter()))
            if i % self.tokens_per_chunk:
                continue  # packed into the chunk sent at i - i % tokens_per_chunk
            word = "".join(f" w{j}" for j in range(i, min(n, i + self.tokens_per_chunk)))
            choice = ({"index": 0, "delta": {"content": word}} if is_chat
                      else {"index": 0, "text": word})
            await _send(resp, {"choices": [choice]})
            if i == 0 and "FAIL_STREAM" in prompt:
                await _send(resp, {"error": {"message": "injected stream error"}})
                await resp.write(b"data: [DONE]\n\n")
                return resp
        if self.spec_per_request is not None:
            for i, grow in enumerate(self.spec_per_request):
                self.spec_totals[i] += grow
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            await _send(resp, {"choices": [], "usage": {
                "prompt_tokens": len(prompt.split()), "completion_tokens": n,
                "total_tokens": len(prompt.split()) + n}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
