"""Issue 37's findings, replayed against a real ``blade_llm_server``: each check reproduces what
an attacker or a newcomer did and says whether the server now holds (``ok``) with the numbers.

    python benchmarks/reliability_attacks.py --model demo --out bench_results/attacks

One server (``--api_key``, a 2 s header timeout, a 64 MiB body limit, an open-file limit of
1,024 set before it starts, as on the machine of the report) takes every check but the last,
which starts servers of its own:

  numeric_overflow   top_k 2^63 / 2^64 (completions and chat), chat min_tokens 2^31 without
                     max_tokens, "5" and true for numbers: each a 400 naming the field, while
                     30 ordinary requests sent at the same time all complete.
  huge_ids / many_prompts
                     a 30 MiB body of token ids, 20,000 prompts in one request: a 400, and
                     /health p99 under 100 ms meanwhile (polled every 10 ms from a process of
                     its own); the API process's resident memory before and after.
  half_sent          a request line that never ends is closed after the header timeout.
  idle_sockets       1,100 idle sockets from one client: those past the cap get 503, the
                     others are closed by the header timeout, accept errors (if a burst
                     runs out of descriptors) logged at most once; /health answers afterwards.
  chunked_413        a chunked upload that goes on after its 413: the connection is closed and
                     further sends fail within a second.
  nested_tool_args   tool-call arguments nested 5,000 deep: 400, not 500.
  openapi_bodies     /openapi.json declares a request body for every POST endpoint that takes
                     one (a cancel by id takes none).
  docs_and_bearer    /docs open without the key (documented), a lowercase "bearer" accepted.
  min_tokens_alike   chat and completions give the same answer for min_tokens > max_tokens.
  metrics_kv_total   /metrics shows the KV pool's total blocks before any request ran.
  sigterm_startup    SIGTERM 0.5, 1, 2 and 4 s after launch: exit status 0, no traceback.

The adapter registry's findings need an adapter folder (tests/unit/lora/
test_lora_registry_bounds.py replays them); a fault inside the runner cannot be sent through
the API any more (numeric_overflow was the way in): tests/e2e/test_reliability_step.py and
test_pp_culprit_isolation.py inject one.
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

import httpx

READY = re.compile(r"ready at (http://[\d.]+:\d+)")
KEY = "attack-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPEN_FILES = 1024
CHECKS = ("numeric_overflow", "huge_ids", "many_prompts", "half_sent", "idle_sockets",
          "chunked_413", "nested_tool_args", "openapi_bodies", "docs_and_bearer",
          "min_tokens_alike", "metrics_kv_total", "sigterm_startup")


class Server:
    """A server process with its output in ``log_path`` (and in memory)."""

    def __init__(self, args: list[str], log_path: Path, code: str,
                 open_files: int | None = None) -> None:
        def limit() -> None:
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        self.log_path = log_path
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bladellm.entrypoints.cli.server", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=code,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": code},
            preexec_fn=limit)
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                self.lines.append(line)
                m = READY.search(line)
                if m and self.url is None:
                    self.url = m.group(1)
                    self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout: float = 900) -> str:
        self.ready.wait(timeout)
        if self.url is None:
            raise RuntimeError(f"server did not start; see {self.log_path}")
        return self.url

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# ---------------------------------------------------------------------------------- checks


async def numeric_overflow(url: str, model: str) -> dict:
    bad = [("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),
           ("/v1/completions", {"prompt": "hi", "top_k": 2**64}, "top_k"),
           ("/v1/chat/completions", {"top_k": 2**63}, "top_k"),
           ("/v1/chat/completions", {"min_tokens": 2**31}, "min_tokens"),
           ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
           ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature")]
    messages = [{"role": "user", "content": "Name a colour."}]
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=AUTH) as http:
        async def innocent(i: int) -> int:
            r = await http.post("/v1/completions", json={
                "model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": 8,
                "ignore_eos": True, "seed": i})
            return r.status_code

        async def attack(path: str, extra: dict, field: str) -> dict:
            body = {"model": model, **({"messages": messages} if "chat" in path else {}),
                    **extra}
            r = await http.post(path, json=body)
            param = r.json().get("error", {}).get("param") if r.status_code < 500 else None
            return {"field": field, "status": r.status_code, "param": param}

        got = await asyncio.gather(*(innocent(i) for i in range(30)),
                                   *(attack(*b) for b in bad))
    innocents, attacks = got[:30], got[30:]
    ok = all(s == 200 for s in innocents) and all(
        a["status"] == 400 and a["param"] == a["field"] for a in attacks)
    return {"ok": ok, "innocent_statuses": sorted(set(innocents)), "attacks": attacks}


_POLLER = """
import json, os, sys, time
import httpx
url, stop = sys.argv[1], sys.argv[2]
out = []
with httpx.Client(base_url=url, timeout=30) as http:
    while not os.path.exists(stop):
        start = time.monotonic()
        http.get("/health")
        out.append(time.monotonic() - start)
        time.sleep(max(0.0, 0.01 - (time.monotonic() - start)))
print(json.dumps(out))
"""


def _refused_while_polled(srv: Server, raw: bytes, out: Path) -> dict:
    stop = out / "poller.stop"
    stop.unlink(missing_ok=True)
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, srv.url, str(stop)],
                              stdout=subprocess.PIPE, text=True)
    rss_before = _rss_mib(srv.proc.pid)
    statuses = []
    try:
        time.sleep(0.5)
        for _ in range(3):
            r = httpx.post(srv.url + "/v1/completions", content=raw, timeout=300,
                           headers={**AUTH, "content-type": "application/json"})
            statuses.append(r.status_code)
        time.sleep(0.2)
    finally:
        stop.touch()
        latencies, _ = poller.communicate(timeout=120)
    lat = sorted(json.loads(latencies))
    p99 = lat[int(0.99 * (len(lat) - 1))]
    return {"ok": statuses == [400] * 3 and p99 < 0.1, "statuses": statuses,
            "body_mib": round(len(raw) / (1 << 20), 1), "health_polls": len(lat),
            "health_p99_ms": round(p99 * 1e3, 1), "health_max_ms": round(lat[-1] * 1e3, 1),
            "api_rss_mib_before": rss_before, "api_rss_mib_after": _rss_mib(srv.proc.pid)}


def huge_ids(srv: Server, model: str, out: Path) -> dict:
    raw = json.dumps({"model": model, "prompt": list(range(100, 4_000_000)),
                      "max_tokens": 1}).encode()
    return _refused_while_polled(srv, raw, out)


def many_prompts(srv: Server, model: str, out: Path) -> dict:
    raw = json.dumps({"model": model, "prompt": ["hello"] * 20_000, "max_tokens": 1}).encode()
    return _refused_while_polled(srv, raw, out)


def half_sent(url: str, header_timeout: float) -> dict:
    with socket.create_connection(_address(url), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        start = time.monotonic()
        closed = sock.recv(1) == b""
        took = time.monotonic() - start
    return {"ok": closed and took < header_timeout + 2, "closed_after_s": round(took, 2),
            "header_timeout_s": header_timeout}


def idle_sockets(srv: Server, count: int = 1100) -> dict:
    """``count`` sockets opened at once, nothing sent. Those past the cap (the open-file limit
    less a reserve) are answered 503; the rest are closed by the header timeout. A burst of
    connects can still run accept() out of descriptors for a moment (asyncio accepts a whole
    burst before any connection is answered): then it pauses accepting for 1 s and the log
    gets one line, not one per try."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count + 100:  # this client's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1000), hard))
    log_before = len(srv.lines)
    socks = []
    answers: dict[str, int] = {}
    try:
        start = time.monotonic()
        for _ in range(count):
            socks.append(socket.create_connection(_address(srv.url), timeout=10))
        for sock in socks:
            sock.setblocking(False)
        while time.monotonic() - start < 15:  # until every socket is answered or closed
            answers = {"503": 0, "closed": 0, "waiting": 0}
            for sock in socks:
                try:
                    head = sock.recv(12, socket.MSG_PEEK)
                    answers["503" if head.startswith(b"HTTP/1.1 503") else "closed"] += 1
                except BlockingIOError:
                    answers["waiting"] += 1
                except ConnectionResetError:
                    answers["closed"] += 1
            if not answers["waiting"]:
                break
            time.sleep(0.25)
        took = round(time.monotonic() - start, 2)
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.5)
    health = httpx.get(srv.url + "/health", timeout=10).status_code
    lines = srv.lines[log_before:]
    reports = sum("out of system resource" in line for line in lines)
    return {"ok": answers.get("503", 0) > 0 and not answers.get("waiting") and reports <= 1
            and health == 200, "sockets": count, "answers": answers, "all_settled_s": took,
            "accept_error_log_records": reports, "log_bytes_during": len("".join(lines)),
            "health_after": health}


def chunked_413(url: str) -> dict:
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    pushed = 0
    with socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        start = time.monotonic()
        closed_after = None
        try:
            while time.monotonic() - start < 10:
                sock.sendall(chunk)
                pushed += len(chunk)
        except OSError:
            closed_after = round(time.monotonic() - start, 2)
    return {"ok": closed_after is not None and closed_after < 5, "pushed_mib":
            round(pushed / (1 << 20), 1), "closed_after_s": closed_after}


async def simple_checks(url: str, model: str) -> dict:
    results = {}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as http:
        deep = "[" * 5000 + "]" * 5000
        r = await http.post("/v1/chat/completions", json={"model": model, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]})
        results["nested_tool_args"] = {"ok": r.status_code == 400, "status": r.status_code}

        spec = (await http.get("/openapi.json")).json()
        posts = {path: op["post"] for path, op in spec["paths"].items() if "post" in op}
        missing = sorted(p for p, op in posts.items()
                         if "requestBody" not in op and not p.endswith("/cancel"))
        results["openapi_bodies"] = {"ok": bool(posts) and not missing,
                                     "post_endpoints": len(posts), "without_body": missing}

        async with httpx.AsyncClient(base_url=url, timeout=60) as no_key:
            docs = (await no_key.get("/docs")).status_code
            keyless = await no_key.get("/v1/models")
        lower = await http.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        results["docs_and_bearer"] = {"ok": docs == 200 and lower.status_code == 200
                                      and keyless.status_code == 401, "docs": docs,
                                      "lowercase_bearer": lower.status_code,
                                      "no_key": keyless.status_code}

        answers = {}
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]})):
            r = await http.post(path, json={"model": model, "min_tokens": 20, "max_tokens": 10,
                                            **extra})
            answers[path] = (r.status_code, r.json().get("error", {}).get("param"))
        results["min_tokens_alike"] = {"ok": set(answers.values()) == {(400, "min_tokens")},
                                       "answers": answers}
    return results


def metrics_kv_total(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^bladellm_kv_cache_total_blocks(?:\{[^}]*\})? (\S+)$", text, re.M)
    total = float(m.group(1)) if m else 0.0
    return {"ok": total > 0, "total_blocks": total}


def sigterm_startup(args: argparse.Namespace, out: Path) -> dict:
    runs = {}
    for delay in (0.5, 1.0, 2.0, 4.0):
        srv = Server(["--model", args.model, "--host", "127.0.0.1", "--port", "0"],
                     out / f"server_sigterm_{delay}.log", args.code)
        time.sleep(delay)
        code = srv.stop()
        srv.ready.wait(10)  # output drained
        runs[str(delay)] = {"exit": code, "traceback": "Traceback" in srv.text()}
    return {"ok": all(r["exit"] in (0, -signal.SIGTERM) and not r["traceback"]
                      for r in runs.values()), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--out", default="bench_results/attacks")
    ap.add_argument("--server_args", default="", help="extra server flags")
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]),
                    help="checkout whose server is tested (e.g. a baseline worktree)")
    ap.add_argument("--checks", default=",".join(CHECKS),
                    help="comma-separated subset of: " + ", ".join(CHECKS))
    args = ap.parse_args()
    checks = set(args.checks.split(","))
    if not checks <= set(CHECKS):
        ap.error(f"--checks: unknown {sorted(checks - set(CHECKS))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header_timeout = 2.0
    base = ["--model", args.model, "--served_model_name", "m", "--host", "127.0.0.1",
            "--port", "0", "--disable_access_log", "--api_key", KEY,
            "--max_request_body_bytes", "64MiB", "--http_header_timeout", str(header_timeout),
            *args.server_args.split()]
    results: dict = {"model": args.model, "server_args": base, "code": args.code}

    def record(name: str, result: dict) -> None:
        results[name] = result
        print(name, json.dumps(result), flush=True)

    if checks - {"sigterm_startup"}:
        srv = Server(base, out / "server.log", args.code, open_files=OPEN_FILES)
        try:
            url = srv.wait_ready()
            if "metrics_kv_total" in checks:  # first: before any request reaches the engine
                record("metrics_kv_total", metrics_kv_total(url))
            if "numeric_overflow" in checks:
                record("numeric_overflow", asyncio.run(numeric_overflow(url, "m")))
            if "huge_ids" in checks:
                record("huge_ids", huge_ids(srv, "m", out))
            if "many_prompts" in checks:
                record("many_prompts", many_prompts(srv, "m", out))
            if "half_sent" in checks:
                record("half_sent", half_sent(url, header_timeout))
            if "idle_sockets" in checks:
                record("idle_sockets", idle_sockets(srv))
            if "chunked_413" in checks:
                record("chunked_413", chunked_413(url))
            simple = asyncio.run(simple_checks(url, "m"))
            for name in ("nested_tool_args", "openapi_bodies", "docs_and_bearer",
                         "min_tokens_alike"):
                if name in checks:
                    record(name, simple[name])
        finally:
            code = srv.stop()
        results["exit"] = {"code": code, "tracebacks_in_log": srv.text().count("Traceback")}
    if "sigterm_startup" in checks:
        record("sigterm_startup", sigterm_startup(args, out))
    results["all_ok"] = all(v.get("ok", True) for v in results.values() if isinstance(v, dict)
                            and "ok" in v)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("all_ok", results["all_ok"], flush=True)
    sys.exit(0 if results["all_ok"] else 1)


if __name__ == "__main__":
    main()
