"""The real server stays responsive while it refuses huge bodies (issue 37 item 3): /health p99
under 100 ms while a 30 MiB body of token ids, or 20,000 prompts, is received and refused."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from test_server import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(["--model", tiny_llama, "--served_model_name", "tiny", "--host",
                         "127.0.0.1", "--port", "0", "--dtype", "float32", "--num_threads", "1",
                         "--disable_access_log", "--max_request_body_bytes", "64MiB"])
    srv.wait_ready(timeout=240)
    yield srv
    srv.proc.terminate()
    srv.proc.wait(30)


def _health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    """One /health every 10 ms on a schedule, on a kept-alive connection."""
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            out.append(time.monotonic() - start)
            time.sleep(max(0.0, 0.01 - (time.monotonic() - start)))


@pytest.mark.slow
@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": list(range(100, 4_000_000)), "max_tokens": 1},  # 30 MiB
    {"model": "tiny", "prompt": ["hello"] * 20_000, "max_tokens": 1},
], ids=["30MiB-of-ids", "20000-prompts"])
def test_health_p99_while_a_huge_body_is_refused(server, body):
    raw = json.dumps(body).encode()
    assert len(raw) >= 30 << 20 or len(body["prompt"]) == 20_000
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_latencies, args=(server.url, stop, latencies))
    poller.start()
    try:
        time.sleep(0.2)
        for _ in range(3):
            r = httpx.post(server.url + "/v1/completions", content=raw, timeout=120,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text[:500]
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.1, (p99, latencies[-5:])
