"""Reliability under load, end to end against real ``blade_llm_server`` processes (the findings
of issue 37, one by one: ``benchmarks/reliability_attacks.py``).

    python benchmarks/reliability.py --model demo --out bench_results/reliability

Phases (each against a server this script starts and watches):
  huge_prompt       a 10 MiB prompt while /health is polled (worst /health latency).
  load64 / load256  closed-loop load at concurrency 64 and 256 (chat + completions, streaming and
                    not); every response checked; KV blocks must return to 0 afterwards.
  disconnect        streams dropped by the client after their first token; KV back to 0.
  sigterm           SIGTERM with requests in flight: every client must get a complete answer,
                    a 503 error body or an SSE error event + [DONE]; exit status 0 within
                    --shutdown_timeout + 2 s; no traceback in the log.
  engine_kill       SIGKILL of the engine-core process under load: every client gets an error
                    (never a hang), the server exits 1 (no --keep_serving_on_engine_death).
/metrics is scraped every 0.5 s during the run (``metrics_series.json``, vLLM names);
``benchmarks/plot_metrics.py`` draws it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

EXIT_WAIT_S = 30
READY = re.compile(r"ready at (http://[\d.]+:\d+)")
SCRAPED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
           "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
           "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")


PHASES = ("huge_prompt", "load64", "load256", "disconnect", "sigterm", "engine_kill")


class Server:
    def __init__(self, args: list[str], log_path: Path, code: str) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        # cwd and PYTHONPATH both name the checkout under test (`-m` puts cwd first on sys.path).
        self.proc = subprocess.Popen([sys.executable, "-m", "bladellm.entrypoints.cli.server",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=code,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1",
                                          "PYTHONPATH": code})
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.log.write(line)
            self.log.flush()
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def wait_ready(self) -> str:
        self.ready.wait(900)
        if self.url is None:
            raise RuntimeError(f"server did not start; see {self.log_path}")
        return self.url

    def core_pid(self) -> int:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                    cmd = open(f"/proc/{entry}/cmdline").read()
                except OSError:
                    continue
                if int(stat[1]) == self.proc.pid and "resource_tracker" not in cmd:
                    return int(entry)
        raise RuntimeError("no engine-core child")

    def text(self) -> str:
        return self.log_path.read_text()


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name in SCRAPED or name == "bladellm_kv_cache_used_blocks":
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def scraper(url: str, series: list, stop: asyncio.Event, phase: list[str]) -> None:
    start = time.time()
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while not stop.is_set():
            try:
                r = await http.get("/metrics")
                series.append({"t": time.time() - start, "phase": phase[0],
                               **parse_metrics(r.text)})
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)


def _body(i: int, stream: bool, max_tokens: int) -> tuple[str, dict]:
    if i % 2:
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Request {i}: name a colour."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "temperature": 0.7,
            "seed": i}
    return "/v1/completions", {"prompt": f"Request {i}: once upon a time", "stream": stream,
                               "max_tokens": max_tokens, "ignore_eos": True, "seed": i}


async def one(http: httpx.AsyncClient, i: int, max_tokens: int, drop_after_first=False) -> str:
    """Outcome: ok | error_event | http_<status> | cut (stream ended without [DONE]) |
    dropped | exc_<type>."""
    stream = i % 4 < 2
    path, body = _body(i, stream, max_tokens)
    try:
        if not stream:
            r = await http.post(path, json=body)
            if r.status_code != 200:
                return f"http_{r.status_code}"
            usage = r.json()["usage"]
            return "ok" if usage["completion_tokens"] == max_tokens else "short"
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"http_{r.status_code}"
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if drop_after_first:
                        return "dropped"
            if not events or events[-1] != "[DONE]":
                return "cut"
            return "error_event" if '"error"' in events[-2] else "ok"
    except httpx.HTTPError as e:
        return f"exc_{type(e).__name__}"


async def load(url: str, n: int, concurrency: int, max_tokens: int, **kw) -> dict:
    sem = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def guarded(i: int) -> None:
            async with sem:
                o = await one(http, i, max_tokens, **kw)
                outcomes[o] = outcomes.get(o, 0) + 1

        start = time.monotonic()
        await asyncio.gather(*(guarded(i) for i in range(n)))
        took = time.monotonic() - start
    return {"requests": n, "concurrency": concurrency, "seconds": round(took, 2),
            "outcomes": outcomes}


async def huge_prompt(url: str, mib: int = 10) -> dict:
    """A prompt of ``mib`` MiB (under the body limit) while /health is polled: the worst /health
    latency says whether the event loop stalled."""
    body = {"prompt": "hello world " * ((mib << 20) // 12), "max_tokens": 1}
    worst, polls = 0.0, 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.monotonic()
        task = asyncio.ensure_future(http.post("/v1/completions", json=body))
        while not task.done():
            t = time.monotonic()
            await http.get("/health")
            worst, polls = max(worst, time.monotonic() - t), polls + 1
            await asyncio.sleep(0.05)
        r = await task
    return {"status": r.status_code, "seconds": round(time.monotonic() - start, 2),
            "worst_health_latency_s": round(worst, 3), "health_polls": polls}


async def kv_used(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        for _ in range(100):
            used = parse_metrics((await http.get("/metrics")).text)["bladellm_kv_cache_used_blocks"]
            if used == 0:
                return 0
            await asyncio.sleep(0.1)
    return used


async def under_signal(srv: Server, n: int, max_tokens: int, action) -> dict:
    """Start n requests, wait until they run, apply ``action``; collect outcomes and exit."""
    url = srv.url
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=n + 4)) as http:
        async def run(i: int) -> None:
            o = await one(http, i, max_tokens)
            outcomes[o] = outcomes.get(o, 0) + 1

        tasks = [asyncio.ensure_future(run(i)) for i in range(n)]
        for _ in range(600):
            text = (await http.get("/metrics")).text
            running = re.search(r"^(?:vllm:|bladellm_)num_requests_running\S* (\S+)$", text,
                                re.M)
            if running and float(running.group(1)) >= 1:
                break
            await asyncio.sleep(0.05)
        sent = time.monotonic()
        action()
        await asyncio.gather(*tasks)
    clients_done = round(time.monotonic() - sent, 2)
    try:
        code = await asyncio.to_thread(srv.proc.wait, EXIT_WAIT_S)
        exited = round(time.monotonic() - sent, 2)
    except subprocess.TimeoutExpired:  # e.g. a server that keeps running without its engine
        code, exited = None, f"still running after {EXIT_WAIT_S} s"
        srv.proc.terminate()
        try:
            srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait()
    return {"requests": n, "outcomes": outcomes, "exit_code": code,
            "seconds_until_clients_done": clients_done, "seconds_to_exit": exited,
            "tracebacks_in_log": srv.text().count("Traceback")}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--out", default="bench_results/reliability")
    ap.add_argument("--requests64", type=int, default=1000, help="requests at concurrency 64")
    ap.add_argument("--requests256", type=int, default=1000, help="requests at concurrency 256")
    ap.add_argument("--max_tokens", type=int, default=16)
    ap.add_argument("--grace", type=float, default=5.0, help="--shutdown_timeout of the server")
    ap.add_argument("--server_args", default="", help="extra server flags")
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                    help="checkout whose server is tested (e.g. a baseline worktree)")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="comma-separated subset of: " + ", ".join(PHASES))
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    if not phases <= set(PHASES):
        ap.error(f"--phases: unknown {sorted(phases - set(PHASES))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["--model", args.model, "--host", "127.0.0.1", "--port", "0", "--disable_access_log",
            "--max_request_body_bytes", "16MiB",
            "--shutdown_timeout", str(args.grace), *args.server_args.split()]
    results: dict = {"model": args.model, "server_args": base, "code": args.code}
    series: list = []
    phase = ["start"]
    srv = Server(base, out / "server.log", args.code)
    url = srv.wait_ready()
    stop = asyncio.Event()
    scrape = asyncio.ensure_future(scraper(url, series, stop, phase))
    if "huge_prompt" in phases:
        phase[0] = "huge_prompt"
        results["huge_prompt"] = await huge_prompt(url)
        print("huge_prompt", results["huge_prompt"], flush=True)
    for name, n, c in (("load64", args.requests64, 64), ("load256", args.requests256, 256)):
        if name not in phases:
            continue
        phase[0] = name
        results[name] = await load(url, n, c, args.max_tokens)
        results[name]["kv_used_blocks_after"] = await kv_used(url)
        print(name, results[name], flush=True)
    if "disconnect" in phases:
        phase[0] = "disconnect"
        results["disconnect"] = await load(url, 64, 64, 200, drop_after_first=True)
        results["disconnect"]["kv_used_blocks_after"] = await kv_used(url)
        print("disconnect", results["disconnect"], flush=True)
    if "sigterm" in phases:
        phase[0] = "sigterm"
        results["sigterm"] = await under_signal(
            srv, 64, 200, lambda: srv.proc.send_signal(signal.SIGTERM))
        results["sigterm"]["grace_s"] = args.grace
        print("sigterm", results["sigterm"], flush=True)
    else:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(EXIT_WAIT_S)
    stop.set()
    await scrape
    if "engine_kill" in phases:
        srv2 = Server(base, out / "server_engine_kill.log", args.code)
        srv2.wait_ready()
        core = srv2.core_pid()
        results["engine_kill"] = await under_signal(srv2, 64, 200,
                                                    lambda: os.kill(core, signal.SIGKILL))
        print("engine_kill", results["engine_kill"], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "metrics_series.json").write_text(json.dumps(series))


if __name__ == "__main__":
    asyncio.run(main())
