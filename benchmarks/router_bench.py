"""Prompt-cache-aware routing vs round robin vs one instance on a RAG-like workload.

Starts two ``blade_llm_server`` instances of a model (one engine thread each) and two
``blade_llm_router``s over them (prefix_affinity, round_robin), then runs ``blade_llm_bench``
(shared-prefix dataset: ``--docs`` distinct documents of ``--doc_words`` words, a short question
each) at each request rate against: one instance directly, the round-robin router, the affinity
router, interleaved per rate (the order rotates) so machine noise hits all three alike. Each run
gets fresh documents (its own seed). Writes ``summary.md`` / ``summary.json`` to ``--out``.

    flock /tmp/bladellm-bench.lock python benchmarks/router_bench.py --out /tmp/router_bench
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import httpx

from bladellm.bench.metrics import max_qps_meeting_slo

READY = re.compile(r"ready at (http://[\d.]+:\d+)")


def start(cmd: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = READY.search(f.read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2]} exited; see {log_path}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start; see {log_path}")


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        hits += float(re.search(r"^bladellm_prefix_cache_hits_total (\S+)$", text, re.M)[1])
        queries += float(re.search(r"^bladellm_prefix_cache_queries_total (\S+)$", text, re.M)[1])
    return hits, queries


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="demo")
    p.add_argument("--kv_cache_memory", default="100MiB")
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--doc_words", type=int, default=450)
    p.add_argument("--question_words", default="15,25")
    p.add_argument("--output_len", type=int, default=8)
    p.add_argument("--rates", default="0.25,0.5,1,1.5")
    p.add_argument("--num_prompts", type=int, default=24)
    p.add_argument("--slo", default="ttft:3000")
    p.add_argument("--slo_target", type=float, default=0.9)
    p.add_argument("--base_port", type=int, default=8150)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    procs = []
    try:
        urls = []
        for i in range(2):
            proc, url = start([py, "-m", "bladellm.entrypoints.cli.server", "--model", args.model,
                               "--host", "127.0.0.1", "--port", str(args.base_port + i),
                               "--num_threads", "1", "--kv_cache_memory", args.kv_cache_memory,
                               "--max_model_len", str(args.max_model_len),
                               "--disable_access_log"], f"{args.out}/server{i}.log")
            procs.append(proc)
            urls.append(url)
        targets = {"single": (urls[0], [urls[0]])}
        for j, policy in enumerate(("round_robin", "prefix_affinity")):
            proc, url = start([py, "-m", "bladellm.entrypoints.cli.router", "--host",
                               "127.0.0.1", "--port", str(args.base_port + 10 + j), "--policy",
                               policy, "--instances", *urls], f"{args.out}/router_{policy}.log")
            procs.append(proc)
            targets[policy] = (url, urls)
        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        rates = args.rates.split(",")
        entries: dict[str, list[dict]] = {name: [] for name in targets}
        hit_rates: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for k, rate in enumerate(rates):
            for name in names[k % 3:] + names[:k % 3]:
                base_url, inst = targets[name]
                h0, q0 = cache_counts(inst)
                label = f"{name}_r{rate}"
                subprocess.run([py, "-m", "bladellm.entrypoints.cli.bench", "--base_url",
                                base_url, "--model", model, "--dataset", "shared_prefix",
                                "--num_groups", str(args.docs), "--prefix_len",
                                str(args.doc_words), "--input_len_range", args.question_words,
                                "--output_len_range", f"{args.output_len},{args.output_len}",
                                "--ignore_eos", "--request_rate", rate, "--num_prompts",
                                str(args.num_prompts), "--seed", str(1000 * k + len(name)),
                                "--slo", args.slo, "--slo_target", str(args.slo_target),
                                "--output_dir", f"{args.out}/runs", "--label", label,
                                "--disable_tqdm"], check=True, stdout=subprocess.DEVNULL)
                h1, q1 = cache_counts(inst)
                with open(f"{args.out}/runs/{label}.json") as f:
                    entry = json.load(f)["rates"][0]
                entry.pop("requests", None)
                entries[name].append(entry)
                hit_rates[name].append((h1 - h0) / max(1.0, q1 - q0))
                print(f"rate {rate} {name}: {entry['request_throughput']:.2f} req/s, TTFT p50 "
                      f"{entry['ttft_ms']['p50']:.0f} p99 {entry['ttft_ms']['p99']:.0f} ms, SLO "
                      f"{entry['slo_attainment']:.0%}, cache hits {hit_rates[name][-1]:.0%}",
                      flush=True)
        summary = {"args": vars(args), "python": sys.version.split()[0],
                   "torch": __import__("torch").__version__, "configs": {}}
        lines = ["| config | rate (req/s) | achieved req/s | TTFT p50 ms | TTFT p99 ms | "
                 "SLO met | prompt-cache hit rate |", "|---|---|---|---|---|---|---|"]
        for name in names:
            best = max_qps_meeting_slo(entries[name], args.slo_target)
            summary["configs"][name] = {"max_qps_at_slo": best["request_throughput"]
                                        if best else 0.0, "rates": entries[name],
                                        "hit_rates": hit_rates[name]}
            for e, h in zip(entries[name], hit_rates[name]):
                lines.append(f"| {name} | {e['request_rate']} | {e['request_throughput']:.2f} | "
                             f"{e['ttft_ms']['p50']:.0f} | {e['ttft_ms']['p99']:.0f} | "
                             f"{e['slo_attainment']:.0%} | {h:.0%} |")
        qps = {n: summary["configs"][n]["max_qps_at_slo"] for n in names}
        lines.append("")
        lines.append("max QPS at SLO (" + args.slo + f", {args.slo_target:.0%} of requests): "
                     + ", ".join(f"{n} {q:.2f}" for n, q in qps.items()))
        if qps["round_robin"] > 0:
            lines.append(f"prefix_affinity / round_robin = "
                         f"{qps['prefix_affinity'] / qps['round_robin']:.2f}x")
        with open(f"{args.out}/summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        with open(f"{args.out}/summary.md", "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
