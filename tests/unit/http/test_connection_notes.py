"""Closing slow connections is logged once per interval with a count, not once per connection
(issue 37 item 4: a client holding 1,100 sockets must not become 1,100 log lines)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from bladellm.http.connections import ConnectionLimits, CountedNotes, uvicorn_limits
from bladellm.http.listen import bind_socket


def test_notes_are_counted_once_per_interval(caplog):
    now = [0.0]
    notes = CountedNotes(interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="bladellm.http.connections"):
        for i in range(500):
            now[0] = i * 0.01
            notes.note("connections closed: slow headers")
        now[0] = 12.0
        notes.note("connections closed: slow headers")
        notes.note("connections closed: slow body")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["connections closed: slow headers: 1",
                     "connections closed: slow headers: 500 in the last 12 s",
                     "connections closed: slow body: 1"]


def test_many_slow_connections_make_one_line(caplog):
    limits = ConnectionLimits(header_timeout=0.5, max_connections=100)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(FastAPI(), log_level="warning", **uvicorn_limits(limits)))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    with caplog.at_level(logging.INFO, logger="bladellm.http.connections"):
        thread.start()
        deadline = time.monotonic() + 10
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
        try:
            for client in clients:
                client.sendall(b"GET /")
            for client in clients:  # every one closed by the header timeout
                assert client.recv(1) == b""
        finally:
            for client in clients:
                client.close()
            srv.should_exit = True
            thread.join(10)
    closes = [r.getMessage() for r in caplog.records if "connections closed" in r.getMessage()]
    assert closes == ["connections closed: request headers did not arrive within 0.5 s "
                      "(--http_header_timeout): 1"], closes
