"""Connection hygiene (issue 37 item 4) on a real uvicorn socket with a trivial app: slow
headers, stalled bodies and idle kept-alive connections are closed; past the connection cap a
client gets a 503 at once; a 413 closes the connection; the loop's error reports are rate
limited; the open-file soft limit is raised to the hard one."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from bladellm.http.body_limit import BodyLimitMiddleware, RequestTooLarge, too_large
from bladellm.http.connections import (
    ConnectionLimits, RateLimitedErrors, effective_max_connections, uvicorn_limits)
from bladellm.http.listen import bind_socket

LIMITS = ConnectionLimits(header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.6,
                          max_connections=4)


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimitMiddleware, max_bytes=1000)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        try:
            return JSONResponse({"n": len(await request.body())})
        except RequestTooLarge:
            return too_large(1000).response()

    return app


@pytest.fixture(scope="module")
def server():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_app(), log_level="warning", **uvicorn_limits(LIMITS)))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until EOF; (True, what was read) if the server closed within ``seconds``."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        return True, data
    except (socket.timeout, TimeoutError):
        return False, data
    except ConnectionResetError:
        return True, data


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b'"ok"' not in data:
        data += sock.recv(65536)
    return data


def test_half_sent_request_line_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /hea")
        start = time.monotonic()
        closed, _ = _closed_within(sock, 5)
        assert closed and time.monotonic() - start < LIMITS.header_timeout + 1.5


def test_silent_connection_is_closed(server):
    with _connect(server) as sock:
        closed, _ = _closed_within(sock, 5)
        assert closed


def test_stalled_body_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123")
        start = time.monotonic()
        closed, _ = _closed_within(sock, 5)
        assert closed and time.monotonic() - start < LIMITS.body_timeout + 1.5


def test_a_slow_but_steady_request_is_served(server):
    with _connect(server) as sock:
        for part in (b"POST /echo HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 4\r\n\r\n",
                     b"01", b"23"):
            sock.sendall(part)
            time.sleep(0.3)  # each pause under the timeouts
        assert b'{"n":4}' in sock.recv(65536)


def test_idle_keep_alive_is_closed_and_the_next_request_gets_its_own_deadline(server):
    with _connect(server) as sock:
        assert b"200 OK" in _get(sock)
        assert b"200 OK" in _get(sock)  # kept alive
        sock.sendall(b"GET /he")  # a second request that never completes
        closed, _ = _closed_within(sock, 5)
        assert closed
    with _connect(server) as sock:
        _get(sock)
        start = time.monotonic()
        closed, _ = _closed_within(sock, 5)
        assert closed and time.monotonic() - start < LIMITS.keep_alive_timeout + 1.0


def test_connections_past_the_cap_get_503(server):
    held = [_connect(server) for _ in range(LIMITS.max_connections)]
    try:
        for sock in held:
            assert b"200 OK" in _get(sock)
        with _connect(server) as extra:
            closed, data = _closed_within(extra, 5)
        assert closed and data.startswith(b"HTTP/1.1 503")
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    with _connect(server) as sock:  # room again
        assert b"200 OK" in _get(sock)


def test_413_closes_the_connection_of_a_client_that_keeps_sending(server):
    """One client pushed 41 GiB after its 413: the server kept reading a kept-alive chunked
    upload. Now the 413 closes the connection, and further sends fail."""
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (600, b"x" * 600)
        sock.sendall(chunk * 2)
        sock.settimeout(5)
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 413") and b"connection: close" in data.lower()
        deadline = time.monotonic() + 3  # well under the guard's timeouts: it is the 413
        with pytest.raises(OSError):
            while time.monotonic() < deadline:
                sock.sendall(chunk * 50)
                time.sleep(0.01)


def test_413_by_content_length_closes_the_connection(server):
    with _connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        closed, data = _closed_within(sock, 0.5)
        assert data.startswith(b"HTTP/1.1 413") and closed


def test_loop_errors_are_logged_once_per_interval(caplog):
    now = [0.0]
    handler = RateLimitedErrors(interval=10.0, clock=lambda: now[0])
    error = OSError(24, "Too many open files")
    with caplog.at_level("ERROR"):
        for i in range(1000):
            now[0] = i * 0.01  # 1,000 reports within 10 s
            handler(None, {"message": "socket.accept() out of system resource",
                           "exception": error})
        now[0] = 10.5
        handler(None, {"message": "socket.accept() out of system resource", "exception": error})
        handler(None, {"message": "another kind", "exception": error})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "999 more like it" in lines[1]
    assert "another kind" in lines[2]
    # Descriptor exhaustion: the message only. Another error's first report keeps its traceback.
    assert all(r.exc_info is None for r in caplog.records)
    caplog.clear()
    with caplog.at_level("ERROR"):
        try:
            raise RuntimeError("a bug")
        except RuntimeError as bug:
            handler(None, {"message": "a third kind", "exception": bug})
    assert caplog.records[0].exc_info is not None


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--http_header_timeout"):
        ConnectionLimits(header_timeout=0)
    with pytest.raises(ValueError, match="--max_connections"):
        ConnectionLimits(max_connections=0)
    lowered = effective_max_connections(ConnectionLimits(max_connections=4096), 1024)
    assert lowered.max_connections == 1024 - 128


def test_open_file_soft_limit_is_raised_to_the_hard_one():
    code = ("import resource; from bladellm.http.connections import raise_open_file_limit;"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE);"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard));"
            "got = raise_open_file_limit();"
            "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got;"
            "assert got == (hard if hard != resource.RLIM_INFINITY else 1 << 20) or got > 256;"
            "print(got)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.getcwd(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 256
