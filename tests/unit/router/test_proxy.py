"""The router's proxy against fake instances on 127.0.0.1 (no model): SSE bytes pass through
unchanged and unbuffered, failures before the first byte go elsewhere, a broken stream ends
with a clean error event, health checks take an instance out and put it back, --api_key."""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from bladellm.router.config import RouterConfig
from bladellm.router.proxy import INSTANCE_HEADER, build_router_app

# Odd chunk boundaries on purpose: an event split across chunks, two events in one chunk.
CHUNKS = [b'data: {"choices":[{"text":"He', b'llo"}]}\n\ndata: {"choices":[{"text":" w"}]}\n',
          b'\ndata: {"choices":[{"text":"orld\xc3', b'\xa9"}]}\n\n', b"data: [DONE]\n\n"]


class ThreadServer:
    """An ASGI app served by uvicorn in a thread, on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class FakeInstance:
    """A fake OpenAI server whose stream pauses after its first chunk until ``release``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.healthy = True
        self.release = threading.Event()
        self.bodies: list[bytes] = []
        self.streams_closed = 0  # streams whose generator ended (finished or cancelled)
        self.disconnects = 0  # held requests whose client (the router) went away
        self.lora_status = 200  # what /v1/load_lora_adapter answers
        self.lora_calls: list[tuple[str, bytes]] = []
        app = FastAPI()

        async def hold(request: Request, seconds: float) -> bool:
            """Wait ``seconds``; True if the client disconnected first."""
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.disconnects += 1
                    return True
                await asyncio.sleep(0.01)
            return False

        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            async def simple(request: Request, path: str = path):
                self.bodies.append(await request.body())
                return JSONResponse({"served_by": self.name, "path": path})
            app.post(path)(simple)

        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            async def lora(request: Request, path: str = path):
                self.lora_calls.append((path, await request.body()))
                if self.lora_status != 200:
                    return JSONResponse({"error": {"message": f"no adapter on {self.name}",
                                                   "type": "invalid_request_error",
                                                   "param": None, "code": None}},
                                        status_code=self.lora_status)
                return PlainTextResponse("Success: LoRA adapter 'x' added successfully.")
            app.post(path)(lora)

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "ok"}, status_code=200 if self.healthy else 503)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f"# TYPE bladellm_num_requests_running gauge\n"
                                     f"bladellm_num_requests_running 0\n"
                                     f'fake_info{{name="{self.name}"}} 1\n')

        @app.get("/v1/models")
        async def models():
            return JSONResponse({"object": "list", "data": [{"id": self.name}]})

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.body()
            self.bodies.append(body)
            parsed = json.loads(body)
            if parsed.get("hold"):  # answer (headers included) only after this many seconds
                if await hold(request, parsed["hold"]):
                    return JSONResponse({}, status_code=499)
            if not parsed.get("stream"):
                return JSONResponse({"served_by": self.name})

            async def gen():
                try:
                    yield CHUNKS[0]
                    while not self.release.is_set():  # cancellable, unlike a thread wait
                        await asyncio.sleep(0.01)
                    for c in CHUNKS[1:]:
                        yield c
                finally:
                    self.streams_closed += 1

            return StreamingResponse(gen(), media_type="text/event-stream")

        self.server = ThreadServer(app)
        self.url = self.server.url


class RawServer(socketserver.ThreadingTCPServer):
    """Reads a request, writes ``reply`` bytes, closes: a dying instance."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reply: bytes) -> None:
        reply_bytes = reply

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.recv(65536)
                if reply_bytes:
                    self.request.sendall(reply_bytes)
                self.request.shutdown(socket.SHUT_RDWR)

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def fakes() -> Iterator[list[FakeInstance]]:
    insts = [FakeInstance("a"), FakeInstance("b")]
    yield insts
    for f in insts:
        f.release.set()
        f.server.stop()


def start_router(urls: list[str], **kw) -> ThreadServer:
    kw = {"health_check_interval": 0.05, "health_check_failures": 1, **kw}
    cfg = RouterConfig(instances=urls, host="127.0.0.1", port=0, **kw)
    return ThreadServer(build_router_app(cfg))


def test_sse_passes_through_byte_for_byte_without_buffering(fakes):
    a = fakes[0]
    a.release.clear()
    router = start_router([a.url])
    try:
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", router.url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "stream": True}) as r:
            assert r.status_code == 200 and r.headers[INSTANCE_HEADER] == a.url
            assert r.headers["content-type"].startswith("text/event-stream")
            it = r.iter_raw()
            got = next(it)  # arrives while the instance still holds the rest back
            assert not a.release.is_set()
            a.release.set()
            got += b"".join(it)
        assert got == b"".join(CHUNKS)
    finally:
        router.stop()


def test_dead_instance_before_first_byte_is_retried_elsewhere_and_taken_out(fakes):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead_url = f"http://127.0.0.1:{refused.getsockname()[1]}"
    dropper = RawServer(b"")  # accepts, reads, closes without a byte
    fakes[1].release.set()
    router = start_router([dead_url, dropper.url, fakes[1].url], policy="round_robin",
                          health_check_failures=100)  # only the proxy path marks them down
    try:
        with httpx.Client(timeout=30) as c:
            for _ in range(3):
                r = c.post(router.url + "/v1/completions",
                           json={"model": "m", "prompt": "x", "stream": True})
                assert r.status_code == 200 and r.content == b"".join(CHUNKS)
                assert r.headers[INSTANCE_HEADER] == fakes[1].url
            health = c.get(router.url + "/health").json()
            assert [i["healthy"] for i in health["instances"]] == [False, False, True]
            metrics = c.get(router.url + "/metrics").text
            assert f'bladellm_router_retries_total{{instance="{dead_url}"}}' in metrics
            assert f'fake_info{{instance="{fakes[1].url}",name="b"}} 1.0' in metrics
    finally:
        router.stop()
        dropper.shutdown()
        refused.close()


def test_stream_broken_after_first_byte_ends_with_a_clean_error():
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    first = b'data: {"choices":[{"text":"A"}]}\n\n'
    breaker = RawServer(head + b"%x\r\n" % len(first) + first + b"\r\n")  # then drops
    router = start_router([breaker.url], health_check_failures=100)
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(router.url + "/v1/completions",
                       json={"model": "m", "prompt": "x", "stream": True})
        assert r.status_code == 200
        assert r.content.startswith(first)
        events = [e for e in r.content[len(first):].decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[0].removeprefix("data: "))["error"]
        assert err["type"] == "server_error" and err["code"] == "upstream_error"
    finally:
        router.stop()
        breaker.shutdown()


def test_unhealthy_instance_is_taken_out_and_put_back(fakes):
    a, b = fakes
    router = start_router([a.url, b.url], policy="round_robin")
    try:
        with httpx.Client(timeout=30) as c:
            b.healthy = False
            while c.get(router.url + "/health").json()["instances"][1]["healthy"]:
                time.sleep(0.02)
            served = {c.post(router.url + "/v1/completions",
                             json={"model": "m", "prompt": "x"}).json()["served_by"]
                      for _ in range(4)}
            assert served == {"a"}
            a.healthy = False
            while c.get(router.url + "/health").status_code != 503:
                time.sleep(0.02)
            r = c.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
            a.healthy = b.healthy = True
            while not all(i["healthy"] for i in c.get(router.url + "/health").json()[
                    "instances"]):
                time.sleep(0.02)
            served = {c.post(router.url + "/v1/completions",
                             json={"model": "m", "prompt": "x"}).json()["served_by"]
                      for _ in range(4)}
            assert served == {"a", "b"}
    finally:
        a.healthy = b.healthy = True
        router.stop()


def test_api_key_as_the_server(fakes):
    router = start_router([fakes[0].url], api_key="sekret")
    try:
        with httpx.Client(timeout=30) as c:
            r = c.get(router.url + "/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.get(router.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = c.get(router.url + "/v1/models", headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "a"
            assert c.get(router.url + "/health").status_code == 200  # not behind the key
    finally:
        router.stop()


def test_client_leaving_mid_stream_closes_the_upstream_request(fakes):
    a = fakes[0]
    a.release.clear()
    closed_before = a.streams_closed
    router = start_router([a.url])
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", router.url + "/v1/completions",
                          json={"model": "m", "prompt": "hi", "stream": True}) as r:
                chunks = r.iter_raw()  # kept: a dropped iterator closes the response
                assert next(chunks) == CHUNKS[0]
                health = c.get(router.url + "/health").json()
                assert health["instances"][0]["in_flight"] == 1, health
            # the client is gone: the router drops its upstream request and its accounting
            deadline = time.monotonic() + 10
            while (a.streams_closed == closed_before
                   or c.get(router.url + "/health").json()["instances"][0]["in_flight"]):
                assert time.monotonic() < deadline, "upstream stream not closed"
                time.sleep(0.02)
    finally:
        a.release.set()
        router.stop()


def _counter(metrics: str, line_start: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_request_timeout_is_a_504_not_a_dead_instance_nor_a_retry(fakes):
    a, b = fakes
    router = start_router([a.url, b.url], policy="round_robin", request_timeout=0.5,
                          health_check_interval=60, health_check_failures=100)
    try:
        with httpx.Client(timeout=30) as c:
            bodies_before = len(a.bodies) + len(b.bodies)
            r = c.post(router.url + "/v1/completions",
                       json={"model": "m", "prompt": "x", "hold": 3})
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["type"] == "timeout" and err["code"] == "upstream_timeout"
            assert len(a.bodies) + len(b.bodies) == bodies_before + 1  # not re-sent
            health = c.get(router.url + "/health").json()
            assert [i["healthy"] for i in health["instances"]] == [True, True]
            assert [i["in_flight"] for i in health["instances"]] == [0, 0]
            metrics = c.get(router.url + "/metrics").text
            assert "bladellm_router_retries_total{" not in metrics
            # a stream still waiting for its first byte: also a 504
            r = c.post(router.url + "/v1/completions",
                       json={"model": "m", "prompt": "x", "hold": 3, "stream": True})
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
            # a stream that started: an in-band timeout event, then [DONE]
            a.release.clear()
            b.release.clear()
            r = c.post(router.url + "/v1/completions",
                       json={"model": "m", "prompt": "x", "stream": True})
            assert r.status_code == 200 and r.content.startswith(CHUNKS[0])
            events = [e for e in r.content[len(CHUNKS[0]):].decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[0].removeprefix("data: "))["error"]
            assert err["type"] == "timeout" and err["code"] == "upstream_timeout"
            health = c.get(router.url + "/health").json()
            assert [i["healthy"] for i in health["instances"]] == [True, True]
            assert len(a.bodies) + len(b.bodies) == bodies_before + 3
    finally:
        a.release.set()
        b.release.set()
        router.stop()


def test_only_a_timeout_after_connecting_is_a_request_timeout():
    """A connect timeout (instance unreachable) stays a connection failure: taken out, the
    request goes elsewhere. Only a timeout once connected (total or read) is a 504."""
    import aiohttp

    from bladellm.router import proxy

    assert not proxy._is_request_timeout(aiohttp.ConnectionTimeoutError("connect"))
    assert proxy._is_request_timeout(asyncio.TimeoutError())
    assert proxy._is_request_timeout(aiohttp.SocketTimeoutError("read"))
    assert not proxy._is_request_timeout(aiohttp.ServerDisconnectedError())


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_any_byte_closes_the_upstream_request(fakes, stream):
    a = fakes[0]
    before = a.disconnects
    router = start_router([a.url])
    try:
        async def leave_early() -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                with pytest.raises(httpx.ReadTimeout):
                    await c.post(router.url + "/v1/completions",
                                 json={"model": "m", "prompt": "x", "hold": 30,
                                       "stream": stream}, timeout=0.5)

        asyncio.run(leave_early())
        with httpx.Client(timeout=30) as c:
            deadline = time.monotonic() + 5
            while (a.disconnects == before
                   or c.get(router.url + "/health").json()["instances"][0]["in_flight"]):
                assert time.monotonic() < deadline, "upstream request not closed"
                time.sleep(0.02)
            metrics = c.get(router.url + "/metrics").text
            assert _counter(metrics, f'bladellm_router_requests_total{{instance="{a.url}",'
                                     f'outcome="client_gone"}}') >= 1
    finally:
        router.stop()


def test_retries_counted_only_when_a_retry_follows():
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{refused.getsockname()[1]}"
    router = start_router([dead_url], health_check_failures=100, health_check_interval=60)
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
            metrics = c.get(router.url + "/metrics").text
            assert _counter(metrics, f'bladellm_router_retries_total{{instance="{dead_url}"}}') \
                == 0
            assert _counter(metrics, "bladellm_router_no_instance_total") == 1
    finally:
        router.stop()
        refused.close()


def test_retries_not_counted_past_the_last_attempt():
    """Every attempt answers 503 and --max_retries stops before the healthy instances run out:
    two retries, not three."""
    busy = [RawServer(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            for _ in range(3)]
    router = start_router([s.url for s in busy], policy="round_robin", max_retries=1,
                          health_check_failures=100, health_check_interval=60)
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"})
            assert r.status_code == 503
            metrics = c.get(router.url + "/metrics").text
            total = sum(_counter(metrics, f'bladellm_router_retries_total{{instance="{s.url}"}}')
                        for s in busy)
            assert total == 1
    finally:
        router.stop()
        for s in busy:
            s.shutdown()


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/detokenize"])
def test_single_instance_endpoints_are_forwarded(fakes, path):
    router = start_router([f.url for f in fakes], api_key="k")
    try:
        with httpx.Client(timeout=30) as c:
            body = {"model": "m", "input": "hi", "prompt": "hi", "tokens": [1, 2]}
            assert c.post(router.url + path, json=body).status_code == 401
            r = c.post(router.url + path, json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200 and r.json()["path"] == path
            assert r.headers[INSTANCE_HEADER] in {f.url for f in fakes}
    finally:
        router.stop()


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_lora_adapter_calls_go_to_every_instance(fakes, path):
    a, b = fakes
    router = start_router([a.url, b.url])
    body = {"lora_name": "x", "lora_path": "/p"}
    try:
        with httpx.Client(timeout=30) as c:
            calls = len(a.lora_calls), len(b.lora_calls)
            r = c.post(router.url + path, json=body)
            assert r.status_code == 200 and r.text.startswith("Success"), r.text
            assert (len(a.lora_calls), len(b.lora_calls)) == (calls[0] + 1, calls[1] + 1)
            assert a.lora_calls[-1] == (path, json.dumps(body).encode()) or \
                json.loads(a.lora_calls[-1][1]) == body
            # the same client error everywhere: passed through as one server would answer
            a.lora_status = b.lora_status = 404
            r = c.post(router.url + path, json=body)
            assert r.status_code == 404 and "no adapter on" in r.json()["error"]["message"]
            # one instance failed: 502 naming it, with each instance's result
            b.lora_status = 200
            r = c.post(router.url + path, json=body)
            assert r.status_code == 502, r.text
            out = r.json()
            assert out["error"]["code"] == "instance_failures"
            assert a.url in out["error"]["message"] and "1 of 2" in out["error"]["message"]
            assert [(i["url"], i["ok"], i["status"]) for i in out["instances"]] == [
                (a.url, False, 404), (b.url, True, 200)]
    finally:
        a.lora_status = b.lora_status = 200
        router.stop()


def test_bodies_over_the_limit_are_413_before_the_router_buffers_them(fakes):
    """--max_request_body_bytes as on the server: by Content-Length up front, and counted for a
    chunked upload (no length); the instance never sees either."""
    router = start_router([fakes[0].url], max_request_body_bytes="1KiB")
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x" * 2000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            def chunks():
                for _ in range(8):
                    yield b"x" * 512

            r = c.post(router.url + "/v1/completions", content=chunks(),
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = c.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 200
    finally:
        router.stop()


def test_router_body_limit_flag_is_checked():
    with pytest.raises(ValueError, match="--max_request_body_bytes"):
        RouterConfig(instances=["http://127.0.0.1:1"], max_request_body_bytes="lots")
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        RouterConfig(instances=["http://127.0.0.1:1"], max_request_body_bytes="0")
