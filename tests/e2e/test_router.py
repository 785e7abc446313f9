"""``blade_llm_router`` end to end: two real tiny-model servers on 127.0.0.1 behind router
processes with each policy.

The servers are shared by the module (start-up dominates); the last test kills one of them.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
# tests/e2e is on sys.path (pytest's prepend mode)
from test_server import ServerProcess, _alive, _children

from tiny_models import CORPUS

ROUTER_READY = re.compile(r"router ready at (http://[\d.]+:\d+)")
WORDS = sorted({w for line in CORPUS for w in line.split()})


class RouterProcess:
    def __init__(self, instances: list[str], policy: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bladellm.entrypoints.cli.router", "--host", "127.0.0.1",
             "--port", "0", "--policy", policy, "--health_check_interval", "0.5",
             "--instances", *instances, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self.ready.wait(60) or self.url is None:
            self.proc.kill()
            raise RuntimeError("router did not start:\n" + "".join(self.lines))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = ROUTER_READY.search(line)
            if m and not self.ready.is_set():
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers(tiny_model_factory):
    model = tiny_model_factory("llama")
    procs = []
    for seqs in ("8", "2"):  # the second queues most of its requests (the kill test)
        procs.append(ServerProcess([
            "--model", model, "--served_model_name", "tiny", "--host", "127.0.0.1", "--port",
            "0", "--dtype", "float32", "--max_model_len", "512", "--num_kv_blocks", "512",
            "--block_size", "16", "--max_num_seqs", seqs, "--disable_access_log",
            "--shutdown_timeout", "2", "--num_threads", "1"]))
    for p in procs:
        p.wait_ready(timeout=240)
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.proc.kill()


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{name}_total ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """(prompt-cache hits, lookups) in tokens, summed over the instances."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics").text
        hits += _counter(text, "bladellm_prefix_cache_hits")
        queries += _counter(text, "bladellm_prefix_cache_queries")
    return hits, queries


def text_of(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def shared_prefix_workload(seed: int, groups: int = 3, per_group: int = 6) -> list[str]:
    """Odd ``groups``, so that round robin over two instances sends each group to both."""
    rng = random.Random(seed)
    docs = [text_of(rng, 90) for _ in range(groups)]
    prompts = [f"{docs[g]}\nQuestion {i}: {text_of(rng, 6)}" for i in range(per_group)
               for g in range(groups)]
    return prompts  # groups interleave


def hit_rate(base_url: str, instance_urls: list[str], prompts: list[str]) -> tuple[float, dict]:
    """Send the prompts one by one; the prompt-cache hit rate they caused, and where each
    prompt's document went (first 40 chars -> instances)."""
    h0, q0 = cache_counts(instance_urls)
    placed: dict[str, set[str]] = {}
    with httpx.Client(timeout=60) as c:
        for p in prompts:
            r = c.post(base_url + "/v1/completions",
                       json={"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            placed.setdefault(p[:40], set()).add(r.headers.get("x-bladellm-instance", ""))
    h1, q1 = cache_counts(instance_urls)
    return (h1 - h0) / (q1 - q0), placed


def test_shared_prefix_lands_on_one_instance_and_keeps_the_hit_rate(servers):
    urls = [s.url for s in servers]
    single, _ = hit_rate(urls[0], [urls[0]], shared_prefix_workload(seed=1))
    affinity = RouterProcess(urls, "prefix_affinity")
    rr = RouterProcess(urls, "round_robin")
    try:
        routed, placed = hit_rate(affinity.url, urls, shared_prefix_workload(seed=2))
        rr_rate, rr_placed = hit_rate(rr.url, urls, shared_prefix_workload(seed=3))
    finally:
        affinity.stop()
        rr.stop()
    assert all(len(v) == 1 for v in placed.values()), placed  # each document on one instance
    assert len(set().union(*placed.values())) >= 2  # and the documents spread out
    assert routed >= 0.9 * single, (routed, single)
    # Without affinity the same workload loses hits (so this test can tell them apart).
    assert any(len(v) > 1 for v in rr_placed.values())
    assert rr_rate < 0.9 * single, (rr_rate, single)


async def _send_all(base_url: str, bodies: list[dict],
                    one_by_one: bool = False) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        if one_by_one:  # arrival order = list order
            return [await c.post(base_url + "/v1/completions", json=b) for b in bodies]
        return await asyncio.gather(*(c.post(base_url + "/v1/completions", json=b)
                                      for b in bodies))


def test_least_tokens_balances_uneven_prompts(servers):
    urls = [s.url for s in servers]
    rng = random.Random(5)
    bodies = []
    for i in range(12):  # long, short, long, short...: round robin puts every long on one
        long_ = i % 2 == 0
        bodies.append({"model": "tiny", "prompt": text_of(rng, 150 if long_ else 3),
                       "max_tokens": 48 if long_ else 4, "ignore_eos": True, "temperature": 0})
    cost = [len(b["prompt"]) // 4 + b["max_tokens"] for b in bodies]

    def spread(policy: str, one_by_one: bool = False) -> float:
        router = RouterProcess(urls, policy)
        try:
            resps = asyncio.run(_send_all(router.url, bodies, one_by_one))
        finally:
            router.stop()
        load = dict.fromkeys(urls, 0)
        for r, c in zip(resps, cost):
            assert r.status_code == 200, r.text
            load[r.headers["x-bladellm-instance"]] += c
        return max(load.values()) / max(1, min(load.values()))

    assert spread("least_tokens") < 1.5
    # The workload is uneven enough to tell: round robin, which ignores load, puts every long
    # request on one instance when they arrive in order (sent one by one: concurrent sends
    # may reach the router in any order).
    assert spread("round_robin", one_by_one=True) > 3


def _normalise(sse: bytes) -> bytes:
    return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b'"\\1":X', sse)


def test_sse_is_passed_through_as_the_instance_sent_it(servers):
    url = servers[0].url
    router = RouterProcess([url], "round_robin")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "The quick brown fox"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(timeout=60) as c:
            c.post(url + "/v1/chat/completions", json=body)  # both below hit the same cache
            direct = c.post(url + "/v1/chat/completions", json=body)
            routed = c.post(router.url + "/v1/chat/completions", json=body)
            models = c.get(router.url + "/v1/models").json()
            metrics = c.get(router.url + "/metrics").text
            health = c.get(router.url + "/health").json()
    finally:
        router.stop()
    assert routed.headers["content-type"] == direct.headers["content-type"]
    assert routed.content.endswith(b"data: [DONE]\n\n") and routed.content.count(b"data:") > 3
    assert _normalise(routed.content) == _normalise(direct.content)
    assert models["data"][0]["id"] == "tiny"
    assert f'bladellm_prefix_cache_queries_total{{instance="{url}"}}' in metrics
    assert 'bladellm_router_requests_total{instance="' in metrics
    assert health["status"] == "ok" and health["instances"][0]["healthy"]


async def _stream(c: httpx.AsyncClient, url: str, body: dict, victim: "ServerProcess") -> dict:
    out = {"tokens": 0, "error": None, "done": False, "instance": None}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        out["instance"] = r.headers.get("x-bladellm-instance")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                out["done"] = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                out["error"] = obj["error"]
            elif obj.get("usage") and not obj.get("choices"):
                out["completion_tokens"] = obj["usage"]["completion_tokens"]
            elif obj.get("choices") and obj["choices"][0].get("text") is not None:
                out["tokens"] += 1
                if out["instance"] == victim.url and victim.proc.poll() is None:
                    # SIGKILL, no goodbye to in-flight connections, at once: waking another
                    # task to do it gave the victim time to finish its running requests.
                    victim.proc.kill()
    return out


def test_killed_instance_costs_no_request_that_had_not_started_streaming(servers):
    urls = [s.url for s in servers]
    victim = servers[1]
    router = RouterProcess(urls, "least_tokens")
    # Long enough that the victim cannot finish a running request between the client reading
    # its first token and the kill (the tokens in flight are a small part of 384).
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 384,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    victim_cores = _children(victim.proc.pid)  # its engine-core process
    assert victim_cores

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(_stream(c, router.url, body, victim)
                                          for _ in range(24)))

    try:
        results = asyncio.run(run())
        metrics = httpx.get(router.url + "/metrics").text
        health = httpx.get(router.url + "/health").json()
    finally:
        router.stop()
    broken = [r for r in results if r["error"] is not None]
    assert all(r["status"] == 200 and r["done"] for r in results)
    for r in results:
        if r["error"] is None:
            assert r["completion_tokens"] == body["max_tokens"]  # finished in full, wherever it ran
        else:  # only a request that had streamed from the victim may fail, cleanly
            assert r["instance"] == victim.url and r["tokens"] >= 1
            assert r["error"]["code"] == "upstream_error"
    assert 1 <= len(broken) <= 2  # the victim ran 2 at a time; its queued ones went elsewhere
    retried = re.search(rf'bladellm_router_retries_total{{instance="{re.escape(victim.url)}"}} '
                        r"([0-9.]+)", metrics)
    assert retried and float(retried.group(1)) >= 1, metrics
    assert [i["healthy"] for i in health["instances"]] == [True, False]
    # The victim's engine core, in the middle of requests when its API process was SIGKILLed,
    # notices and exits instead of blocking forever on its output socket.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in victim_cores):
        assert time.monotonic() < deadline, f"orphaned engine core still running: {victim_cores}"
        time.sleep(0.2)
