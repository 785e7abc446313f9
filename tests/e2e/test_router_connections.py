"""``blade_llm_router`` guards its connections as the server does (issue 37 item 4, the router's
side): a half-sent request line is closed after ``--http_header_timeout``, connections past
``--max_connections`` get an immediate 503, a 413 closes the connection, and the open-file soft
limit is raised to the hard one at start-up. The router runs as a real process; its instance
need not exist (nothing here is proxied)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

READY = re.compile(r"router ready at http://[\d.]+:(\d+)")
HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 6


def _lower_open_file_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


@pytest.fixture(scope="module")
def router():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bladellm.entrypoints.cli.router", "--host", "127.0.0.1",
         "--port", "0", "--instances", "http://127.0.0.1:9", "--health_check_interval", "30",
         "--http_header_timeout", str(HEADER_TIMEOUT), "--max_connections",
         str(MAX_CONNECTIONS), "--max_request_body_bytes", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_lower_open_file_limit)
    lines: list[str] = []
    port: list[int] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not port:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(60) or not port:
        proc.kill()
        raise RuntimeError("router did not start:\n" + "".join(lines))
    yield proc.pid, port[0], lines
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_until_closed(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
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


def test_half_sent_request_line_is_closed_after_the_header_timeout(router):
    _, port, _ = router
    with _connect(port) as sock:
        sock.sendall(b"GET /hea")
        start = time.monotonic()
        closed, data = _read_until_closed(sock, 10)
        took = time.monotonic() - start
    assert closed and data == b""
    assert HEADER_TIMEOUT - 0.1 <= took < HEADER_TIMEOUT + 1.5, took


def test_connections_past_the_cap_get_503(router):
    _, port, _ = router
    held = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        with _connect(port) as extra:
            closed, data = _read_until_closed(extra, 5)
        assert closed and data.startswith(b"HTTP/1.1 503"), data
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
            "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5  # room again once the router saw them go
    while True:
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            _, data = _read_until_closed(sock, 5)
        if not data.startswith(b"HTTP/1.1 503") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not data.startswith(b"HTTP/1.1 503"), data


def test_413_closes_the_connection(router):
    _, port, _ = router
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (600, b"x" * 600))
        sock.sendall(b"%x\r\n%s\r\n" % (600, b"x" * 600))
        closed, data = _read_until_closed(sock, HEADER_TIMEOUT / 2)  # before any deadline
    assert closed and data.startswith(b"HTTP/1.1 413"), data
    assert b"connection: close" in data.lower()


def test_open_file_soft_limit_is_raised(router):
    pid, _, lines = router
    limits = open(f"/proc/{pid}/limits").read()
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
    assert soft != "256", limits
    assert soft == hard or int(soft) == 1 << 20, limits
    assert any("open-file limit raised from 256" in line for line in lines), "".join(lines)


def test_accept_errors_are_logged_once_per_interval(router):
    """Out of file descriptors (the soft limit lowered under the router's feet, as a process
    full of sockets would be): accept() fails on every try; the router logs it once per 10 s,
    not once per try, and serves again once descriptors are free."""
    pid, port, lines = router
    before = len(lines)
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    num_open = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (num_open + 2, limits[1]))
    held = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # each connection is accepted, or fails accept()
            held.append(_connect(port))
            time.sleep(0.05)
        log = "".join(lines[before:])
        reports = [x for x in lines[before:] if "out of system resource" in x]
        # asyncio retries accept() every second: 3 reports in 3 s without the rate limit.
        assert len(reports) == 1, log[-3000:]
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            _, data = _read_until_closed(sock, 5)
        if b"too_many_connections" not in data or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert data.startswith(b"HTTP/1.1 ") and b"too_many_connections" not in data, data
