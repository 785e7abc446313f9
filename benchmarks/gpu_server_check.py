"""The OpenAI server on one device (``--device``), answering the official ``openai`` client.

Starts ``bladellm.entrypoints.cli.server`` on a tiny random Llama (tests/tiny_models.py) and
checks, each as one named result: chat, a streamed chat (the chunks join to the non-streamed
text), n=2, seed (two calls with one seed agree), guided_json (``response_format`` json_schema:
the reply parses and has the schema's required keys), and a too-long prompt (a 400, not a
crash). Writes JSON results and the server's log; exit status 1 if any check fails.

    python benchmarks/gpu_server_check.py --device cuda --out gpu-out/server.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
READY = re.compile(r"ready at (http://[\d.]+:\d+)")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}


def start_server(model: str, device: str, log_lines: list[str], log_path: str | None,
                 ready_timeout: float) -> tuple[subprocess.Popen, str]:
    """The server process and its URL once it logs that it is ready. Its output goes, line by
    line as it comes, to ``log_lines`` and to ``log_path`` (so that a run cut off by the
    session's timeout still leaves the log of a slow or stuck start)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bladellm.entrypoints.cli.server", "--model", model,
         "--served_model_name", "tiny", "--host", "127.0.0.1", "--port", "0", "--device", device,
         "--dtype", "float32", "--max_model_len", "512", "--disable_access_log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready = threading.Event()
    url: list[str] = []

    log_file = open(log_path, "w", buffering=1) if log_path else None  # line-buffered

    def drain() -> None:
        for line in proc.stdout:
            log_lines.append(line)
            if log_file is not None:
                log_file.write(line)
            m = READY.search(line)
            if m and not url:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(ready_timeout) or not url:
        proc.kill()
        raise RuntimeError(f"server did not become ready in {ready_timeout:.0f} s:\n"
                           + "".join(log_lines[-40:]))
    return proc, url[0]


def checks(client) -> dict[str, str | None]:
    """Each check's failure message, None where it passed."""
    import openai

    msgs = [{"role": "user", "content": "Say hello"}]
    results: dict[str, str | None] = {}

    def run(name, fn):
        try:
            fn()
            results[name] = None
        except Exception as e:  # noqa: BLE001 - reported per check
            results[name] = f"{type(e).__name__}: {e}"
        print(f"server {name:12s} {'OK' if results[name] is None else 'FAIL ' + results[name]}",
              flush=True)

    def chat():
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                           temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0

    def stream():
        full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                              temperature=0).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True)
            if c.choices]
        assert "".join(parts) == full, ("".join(parts), full)

    def n2():
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,
                                           temperature=1.0)
        assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}

    def seed():
        kw = dict(model="tiny", messages=msgs, max_tokens=16, temperature=1.0, seed=1234)
        a = client.chat.completions.create(**kw).choices[0].message.content
        b = client.chat.completions.create(**kw).choices[0].message.content
        assert a == b, (a, b)

    def guided_json():
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=64, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "n", "schema": SCHEMA}})
        data = json.loads(r.choices[0].message.content)
        assert set(data) == {"name", "count"} and isinstance(data["count"], int), data

    def too_long():
        try:
            client.chat.completions.create(model="tiny", max_tokens=8, messages=[
                {"role": "user", "content": "word " * 2000}])
        except openai.BadRequestError:
            return
        raise AssertionError("a prompt over --max_model_len was accepted")

    for name, fn in [("chat", chat), ("stream", stream), ("n=2", n2), ("seed", seed),
                     ("guided_json", guided_json), ("too_long_400", too_long)]:
        run(name, fn)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    ap.add_argument("--log", help="the server's log, written as it runs")
    ap.add_argument("--ready_timeout", type=float, default=35.0,
                    help="seconds the server may take to start (a tiny model: it needs few)")
    args = ap.parse_args()
    import openai

    from tiny_models import make_tiny_model

    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "llama"), "llama",
                                max_position_embeddings=512)
        start = time.perf_counter()
        proc = None
        try:
            proc, url = start_server(model, args.device, lines, args.log,
                                     args.ready_timeout)
            ready_s = time.perf_counter() - start
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=20,
                                   max_retries=0)
            results = checks(client)
        except Exception as e:  # noqa: BLE001 - a failed start is the result
            ready_s, results = None, {"start": f"{type(e).__name__}: {e}"}
            print(f"server start FAIL {e}", flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary = {"device": args.device, "ready_s": ready_s, "checks": results,
               "ok": all(v is None for v in results.values())}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
