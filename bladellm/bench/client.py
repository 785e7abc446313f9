"""One streamed OpenAI-style request: build the payload, parse SSE, time every chunk."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import aiohttp

from bladellm.bench.datasets import BenchRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestOptions:
    """What every request of a run carries besides its prompt."""

    model: str
    endpoint: str = "completions"
    ignore_eos: bool = False
    eos_logit_bias: tuple[int, ...] = ()
    temperature: float = 0.0
    include_usage: bool = True
    # --priority_mix without --no_priority_field: send each request's class as ``priority``.
    send_priority: bool = True


@dataclass
class RequestResult:
    """Timings are seconds. ``itl`` holds every gap between consecutive chunks with text;
    ``start`` is the send time (perf_counter). ``output_tokens`` comes from the server's usage
    when reported, else from counting token chunks."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    priority: int | None = None  # the request's --priority_mix class
    num_chunks: int = 0
    # Kept only to count its tokens when the server reports no usage; not written to JSON.
    generated_text: str = ""


class SSEParser:
    """Incremental Server-Sent-Events parser: feed bytes as they arrive, get each event's data.

    Handles events split across network reads, CRLF or LF line ends, comment lines, fields other
    than ``data`` and multi-line data (joined with newlines, per the SSE spec)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buf += chunk
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1:]
            event = self._line(line)
            if event is not None:
                yield event

    def close(self) -> Iterator[str]:
        """Flush a last event whose terminating blank line never came."""
        if self._buf:
            event = self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"))
            self._buf = b""
            if event is not None:
                yield event
        if self._data:
            yield "\n".join(self._data)
            self._data = []

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def build_payload(req: BenchRequest, opts: RequestOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": req.output_len,
        "temperature": opts.temperature,
        "stream": True,
    }
    if opts.include_usage:
        payload["stream_options"] = {"include_usage": True}
    if opts.endpoint == "chat":
        messages = [{"role": "system", "content": req.system}] if req.system else []
        content: Any = req.prompt
        if req.images:
            content = [{"type": "image_url", "image_url": {"url": url}} for url in req.images]
            content.append({"type": "text", "text": req.prompt})
        payload["messages"] = messages + [{"role": "user", "content": content}]
    else:
        payload["prompt"] = f"{req.system}\n{req.prompt}" if req.system else req.prompt
    if opts.ignore_eos:
        payload["ignore_eos"] = True
    if opts.eos_logit_bias:
        payload["logit_bias"] = {str(i): -100 for i in opts.eos_logit_bias}
    if req.priority is not None and opts.send_priority:
        payload["priority"] = req.priority
    return payload


def chunk_text(obj: dict[str, Any]) -> str:
    """The generated text a completions or chat chunk carries ('' for role/usage chunks)."""
    parts = []
    for choice in obj.get("choices") or []:
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        parts.append(delta.get("content") or "")
        parts.append(delta.get("reasoning_content") or "")
    return "".join(parts)


def chunk_token_count(obj: dict[str, Any]) -> int:
    """Tokens a chunk stands for when the server reports no usage: one per choice that carries
    text, or that carries an empty text field before the finish (llama.cpp streams partial UTF-8
    tokens that way). Role-only and finish-only chunks count none."""
    n = 0
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text") if "text" in choice else delta.get("content")
        if text:
            n += 1
        elif text is not None and choice.get("finish_reason") is None and "role" not in delta:
            n += 1
    return n


class StreamRecorder:
    """Turns parsed SSE events into a ``RequestResult``; separate from I/O so tests can drive it
    with synthetic timestamps."""

    def __init__(self, start: float, prompt_len: int):
        self.result = RequestResult(start=start, prompt_tokens=prompt_len)
        self._last: float | None = None
        self._counted_tokens = 0
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        res = self.result
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            res.error = f"bad SSE data: {data[:200]!r}"
            return
        if isinstance(obj, dict) and obj.get("error"):
            err = obj["error"]
            res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if usage:
            res.usage_reported = True
            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
            res.output_tokens = usage.get("completion_tokens", res.output_tokens)
        self._counted_tokens += chunk_token_count(obj)
        text = chunk_text(obj)
        if not text:
            return
        res.generated_text += text
        if self._last is None:
            res.ttft = now - res.start
        else:
            res.itl.append(now - self._last)
        self._last = now
        res.num_chunks += 1

    def finish(self, now: float) -> RequestResult:
        res = self.result
        res.e2e = now - res.start
        if not res.usage_reported:
            res.output_tokens = max(self._counted_tokens, res.num_chunks)
        if not res.error and res.num_chunks == 0:
            res.error = "stream ended without generated text"
        res.success = not res.error
        return res


def count_tokens_without_usage(results: list[RequestResult], tokenizer: Any) -> None:
    """Output tokens of successful requests the server reported no usage for: the tokens of
    their generated text, as vLLM's benchmark counts them. The chunk count they had is short
    whenever a chunk packs several tokens (BladeLLM's streams do), which inflated TPOT and
    deflated output throughput. Left as counted when the text encodes to nothing."""
    for r in results:
        if r.success and not r.usage_reported and r.generated_text:
            n = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
            r.output_tokens = n or r.output_tokens


async def send_request(session: aiohttp.ClientSession, base_url: str, req: BenchRequest,
                       opts: RequestOptions) -> RequestResult:
    """Send one streamed request and time it. Never raises: failures land in ``error``."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS[opts.endpoint]
    payload = build_payload(req, opts)
    rec = StreamRecorder(time.perf_counter(), req.prompt_len)
    rec.result.priority = req.priority
    parser = SSEParser()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                rec.result.error = f"HTTP {resp.status}: {body}"
            else:
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        rec.on_event(data, now)
                for data in parser.close():
                    rec.on_event(data, time.perf_counter())
    except asyncio.TimeoutError:
        # str() of aiohttp's total-timeout error is empty: say which limit it was.
        rec.result.error = ("TimeoutError: no complete response within --request_timeout "
                            f"({session.timeout.total:g} s)")
    except Exception as exc:  # noqa: BLE001 - any transport failure is one failed request
        rec.result.error = f"{type(exc).__name__}: {exc}"
    return rec.finish(time.perf_counter())


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["data"][0]["id"]
