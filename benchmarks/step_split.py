"""Where a served step's time goes, under load: the per-step split at several batch sizes.

Starts ``blade_llm_server`` on the model, then for each concurrency C runs ``blade_llm_bench``
with at most C requests in flight (random prompts, ``--ignore_eos``, so the running batch stays
at C while it lasts) and reads ``/metrics`` before and after. The engine core publishes the wall
seconds of its steps by phase (``bladellm_engine_step_phase_seconds_total{phase}``,
core/step_phases.py) and the number of steps; the API process publishes the seconds its event
loop spent on output processing (detokenization, stop strings) and its CPU time. Dividing their
growth by the steps run gives milliseconds per step:

- engine phases: recv, schedule, prepare, forward, logits, sample, executor, update, send;
- ``idle``: the step interval (the run's wall time / steps) minus the phases: the engine waiting
  for requests (between bench waves, the client's ramp-up);
- API ``output``: output processing on the event loop; API ``cpu``: all the API process's CPU
  (HTTP parsing, SSE writes, tokenization, output processing), which competes with the engine's
  threads for the same cores.

    python benchmarks/step_split.py --model_dir /tmp/smollm2-hf --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

PHASES = ("recv", "schedule", "prepare", "forward", "logits", "sample", "executor", "update",
          "send")
_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.e+-]+)$", re.M)


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {name + (labels or ""): float(value) for name, labels, value in _SAMPLE.findall(text)}


def start_server(model_dir: str, port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "bladellm.entrypoints.cli.server", "--model", model_dir,
         "--port", str(port), *extra], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready in 600 s; see {log_path}")


def run_bench(url: str, concurrency: int, num_prompts: int, input_len: int, output_len: int,
              out_dir: str) -> float:
    """The bench's wall time from its first request to its last answer, seconds."""
    subprocess.run(
        ["blade_llm_bench", "--base_url", url, "--dataset", "random",
         "--input_len_range", f"{input_len},{input_len}",
         "--output_len_range", f"{output_len},{output_len}", "--num_prompts", str(num_prompts),
         "--request_rate", "inf", "--max_concurrency", str(concurrency), "--ignore_eos",
         "--num_warmup", "0", "--disable_tqdm", "--output_dir", out_dir,
         "--label", f"c{concurrency}"], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"c{concurrency}.json")) as f:
        return json.load(f)["rates"][0]["duration_s"]  # the requests' span, not the start-up


def split(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = grew("bladellm_engine_steps_total")
    if steps <= 0:
        raise RuntimeError("no engine step ran: is the server bladellm with metrics on?")
    ms = {p: grew(f'bladellm_engine_step_phase_seconds_total{{phase="{p}"}}') / steps * 1e3
          for p in PHASES}
    interval = wall_s / steps * 1e3
    return {"steps": int(steps), "step_interval_ms": interval, "phases_ms": ms,
            "idle_ms": max(0.0, interval - sum(ms.values())),
            "api_output_ms": grew("bladellm_api_output_processing_seconds_total") / steps * 1e3,
            "api_cpu_ms": grew("process_cpu_seconds_total") / steps * 1e3,
            "generated_tokens": int(grew("bladellm_generation_tokens_total"))}


def table(rows: list[dict]) -> str:
    head = ["concurrency", "steps", "step interval", *PHASES, "idle", "API output", "API cpu"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["concurrency"]), str(r["steps"]), f"{r['step_interval_ms']:.2f}",
                 *(f"{r['phases_ms'][p]:.2f}" for p in PHASES), f"{r['idle_ms']:.2f}",
                 f"{r['api_output_ms']:.2f}", f"{r['api_cpu_ms']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num_prompts", type=int, default=0,
                    help="per concurrency; default max(16, 4 x concurrency)")
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18181)
    ap.add_argument("--server_args", default="",
                    help="extra blade_llm_server flags, one string (e.g. '--dtype bfloat16')")
    ap.add_argument("--output_json")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(args.model_dir, args.port, args.server_args.split(),
                            os.path.join(tmp, "server.log"))
        url = f"http://127.0.0.1:{args.port}"
        rows = []
        try:
            # Warm-up: first-call kernel builds, allocator growth.
            run_bench(url, 4, 8, args.input_len, 8, tmp)
            for c in (int(x) for x in args.concurrency.split(",")):
                n = args.num_prompts or max(16, 4 * c)
                before = scrape(url)
                wall = run_bench(url, c, n, args.input_len, args.output_len, tmp)
                rows.append({"concurrency": c, "num_prompts": n, **split(before, scrape(url),
                                                                         wall)})
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(table(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
