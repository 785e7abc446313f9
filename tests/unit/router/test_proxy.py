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
        app = FastAPI()

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
            if not json.loads(body).get("stream"):
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
