"""Start-up to first answer: launch ``blade_llm_server``, wait for /v1/models, ask one chat
question, stop it; repeat. The first run may fill caches (compiled kernels, the demo model's
converted weights); later runs are the "warm machine" number.

    python benchmarks/startup.py --runs 3                  # the demo model
    python benchmarks/startup.py --runs 3 -- --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request


def ask(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": 8, "messages": [
        {"role": "user", "content": "What is the capital of France?"}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)["choices"][0]["message"]["content"]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
            return True
    except OSError:
        return False


def one_run(port: int, server_args: list[str], timeout: float) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bladellm.entrypoints.cli.server",
                             "--port", str(port), *server_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while not ready(port):
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                raise RuntimeError(f"server did not come up (exit code {proc.poll()})")
            time.sleep(0.05)
        up = time.perf_counter() - start
        answer = ask(port)
        return {"ready_s": up, "first_answer_s": time.perf_counter() - start, "answer": answer}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=18099)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("server_args", nargs="*", help="after --: blade_llm_server flags")
    args = ap.parse_args()
    runs = [one_run(args.port, args.server_args, args.timeout) for _ in range(args.runs)]
    for i, r in enumerate(runs):
        print(f"run {i + 1}: ready {r['ready_s']:.1f} s, first answer {r['first_answer_s']:.1f} s"
              f" ({r['answer']!r})")
    if len(runs) > 1:
        warm = [r["first_answer_s"] for r in runs[1:]]
        print(f"warm (runs 2..{len(runs)}): first answer median {statistics.median(warm):.1f} s")


if __name__ == "__main__":
    main()
