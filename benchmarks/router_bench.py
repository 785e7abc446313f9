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
import random
import re
import subprocess
import sys
import threading
import time

import httpx

from bladellm.bench.datasets import WORDS
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


def cache_counts(urls: list[str]) -> list[tuple[float, float]]:
    """(prompt-cache hits, queries) of each instance."""
    out = []
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        out.append((float(re.search(r"^bladellm_prefix_cache_hits_total (\S+)$", text, re.M)[1]),
                    float(re.search(r"^bladellm_prefix_cache_queries_total (\S+)$", text,
                                    re.M)[1])))
    return out


_GAUGE = re.compile(r'^(bladellm_router_in_flight|bladellm_router_outstanding_tokens|'
                    r'bladellm_router_requests_total)\{([^}]*)\} (\S+)$', re.M)


def router_gauges(router_url: str) -> dict[str, dict[str, float]]:
    """{instance: {"in_flight", "tokens", "routed"}} from the router's own metrics."""
    out: dict[str, dict[str, float]] = {}
    text = httpx.get(router_url + "/metrics", timeout=30).text
    for name, labels, value in _GAUGE.findall(text):
        inst = re.search(r'instance="([^"]*)"', labels)[1]
        d = out.setdefault(inst, {"in_flight": 0.0, "tokens": 0.0, "routed": 0.0})
        key = {"bladellm_router_in_flight": "in_flight",
               "bladellm_router_outstanding_tokens": "tokens"}.get(name, "routed")
        d[key] += float(value)
    return out


class LoadSampler(threading.Thread):
    """Samples a router's per-instance load while a run goes (a daemon thread)."""

    def __init__(self, router_url: str, urls: list[str], interval: float) -> None:
        super().__init__(daemon=True)
        self.router_url, self.urls, self.interval = router_url, urls, interval
        self.samples: list[tuple[list[float], list[float]]] = []  # (in_flight, tokens) per inst
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                g = router_gauges(self.router_url)
                self.samples.append(([g.get(u, {}).get("in_flight", 0.0) for u in self.urls],
                                     [g.get(u, {}).get("tokens", 0.0) for u in self.urls]))
            except httpx.HTTPError:
                pass
            self._stop_event.wait(self.interval)

    def stop(self) -> dict:
        self._stop_event.set()
        self.join()
        busy = [s for s in self.samples if sum(s[0]) > 0]
        n = max(1, len(busy))
        return {
            "samples": len(busy),  # samples with anything in flight
            "mean_in_flight": [round(sum(s[0][i] for s in busy) / n, 2)
                               for i in range(len(self.urls))],
            "max_in_flight": [max((s[0][i] for s in busy), default=0)
                              for i in range(len(self.urls))],
            "mean_tokens": [round(sum(s[1][i] for s in busy) / n)
                            for i in range(len(self.urls))],
            # mean |difference| of in-flight requests between the two instances
            "mean_abs_diff": round(sum(abs(s[0][0] - s[0][-1]) for s in busy) / n, 2),
            # share of the busy time where one instance idled while the other had >= 2
            "idle_while_other_2plus": round(sum(
                1 for s in busy if min(s[0]) == 0 and max(s[0]) >= 2) / n, 3),
        }


def paired_dataset(path: str, k: int, name: str, args: argparse.Namespace) -> None:
    """Rows for blade_llm_bench's jsonl dataset: the structure (which document each request
    asks about, question words, their order) comes from the rate index ``k`` alone, so every
    config gets the same; the documents' words come from (k, config), fresh for every run."""
    lo, hi = (int(x) for x in args.question_words.split(","))
    shape = random.Random(f"rows:{k}")
    docs_rng = random.Random(f"docs:{k}:{name}")
    docs = [" ".join(docs_rng.choice(WORDS) for _ in range(args.doc_words))
            for _ in range(args.docs)]
    with open(path, "w") as f:
        for i in range(args.num_prompts):
            question = " ".join(shape.choice(WORDS) for _ in range(shape.randint(lo, hi)))
            f.write(json.dumps({"system": docs[i % args.docs], "prompt": question,
                                "output_len": args.output_len}) + "\n")


def misses(run_json: str, ttft_s: float) -> tuple[int, int]:
    """(requests over the TTFT SLO, of those how many among the first quarter of arrivals)."""
    with open(run_json) as f:
        reqs = json.load(f)["rates"][0]["requests"]
    reqs.sort(key=lambda r: r["start"])
    bad = [i for i, r in enumerate(reqs) if not r["success"] or r["ttft"] > ttft_s]
    return len(bad), sum(1 for i in bad if i < len(reqs) // 4)


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
    p.add_argument("--independent_seeds", action="store_true",
                   help="each config its own seed and shared_prefix dataset (runs 1-3)")
    p.add_argument("--sample_interval", type=float, default=0.25)
    p.add_argument("--router_args", default="",
                   help="extra flags for the prefix_affinity router, e.g. "
                        "'--affinity_balance_factor 1.5'")
    p.add_argument("--also_affinity", default=None,
                   help="flags of a second prefix_affinity router measured as "
                        "'prefix_affinity_alt' in the same run, e.g. "
                        "'--affinity_balance_factor 0' (the rule without bounded loads)")
    args = p.parse_args()
    slo_ttft_s = float(dict(x.split(":") for x in args.slo.split(","))["ttft"]) / 1000
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
        routers = [("round_robin", "round_robin", []),
                   ("prefix_affinity", "prefix_affinity", args.router_args.split())]
        if args.also_affinity is not None:
            routers.append(("prefix_affinity_alt", "prefix_affinity",
                            args.also_affinity.split()))
        for j, (name, policy, extra) in enumerate(routers):
            proc, url = start([py, "-m", "bladellm.entrypoints.cli.router", "--host",
                               "127.0.0.1", "--port", str(args.base_port + 10 + j), "--policy",
                               policy, "--instances", *urls, *extra],
                              f"{args.out}/router_{name}.log")
            procs.append(proc)
            targets[name] = (url, urls)
        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        rates = args.rates.split(",")
        entries: dict[str, list[dict]] = {name: [] for name in targets}
        hit_rates: dict[str, list[float]] = {name: [] for name in targets}
        balance: dict[str, list[dict]] = {name: [] for name in targets}
        names = list(targets)
        os.makedirs(f"{args.out}/data", exist_ok=True)
        for k, rate in enumerate(rates):
            for name in names[k % len(names):] + names[:k % len(names)]:
                base_url, inst = targets[name]
                c0 = cache_counts(inst)
                label = f"{name}_r{rate}"
                if args.independent_seeds:
                    data = ["--dataset", "shared_prefix", "--num_groups", str(args.docs),
                            "--prefix_len", str(args.doc_words), "--input_len_range",
                            args.question_words, "--seed", str(1000 * k + len(name))]
                else:
                    path = f"{args.out}/data/{label}.jsonl"
                    paired_dataset(path, k, name, args)
                    data = ["--dataset", f"jsonl:{path}", "--seed", str(1000 * k)]
                routed0 = router_gauges(base_url) if name != "single" else {}
                sampler = LoadSampler(base_url, inst, args.sample_interval)
                if name != "single":
                    sampler.start()
                subprocess.run([py, "-m", "bladellm.entrypoints.cli.bench", "--base_url",
                                base_url, "--model", model, *data,
                                "--output_len_range", f"{args.output_len},{args.output_len}",
                                "--ignore_eos", "--request_rate", rate, "--num_prompts",
                                str(args.num_prompts),
                                "--slo", args.slo, "--slo_target", str(args.slo_target),
                                "--output_dir", f"{args.out}/runs", "--label", label,
                                "--disable_tqdm"], check=True, stdout=subprocess.DEVNULL)
                c1 = cache_counts(inst)
                bal = {}
                if name != "single":
                    bal = sampler.stop()
                    routed1 = router_gauges(base_url)
                    bal["routed"] = [int(routed1.get(u, {}).get("routed", 0)
                                         - routed0.get(u, {}).get("routed", 0)) for u in inst]
                bal["hit_rate_per_instance"] = [
                    round((b[0] - a[0]) / max(1.0, b[1] - a[1]), 3) for a, b in zip(c0, c1)]
                bal["misses"], bal["misses_first_quarter"] = misses(
                    f"{args.out}/runs/{label}.json", slo_ttft_s)
                balance[name].append(bal)
                with open(f"{args.out}/runs/{label}.json") as f:
                    entry = json.load(f)["rates"][0]
                entry.pop("requests", None)
                entries[name].append(entry)
                hits = sum(b[0] - a[0] for a, b in zip(c0, c1))
                queries = sum(b[1] - a[1] for a, b in zip(c0, c1))
                hit_rates[name].append(hits / max(1.0, queries))
                print(f"rate {rate} {name}: {entry['request_throughput']:.2f} req/s, TTFT p50 "
                      f"{entry['ttft_ms']['p50']:.0f} p99 {entry['ttft_ms']['p99']:.0f} ms, SLO "
                      f"{entry['slo_attainment']:.0%}, cache hits {hit_rates[name][-1]:.0%}, "
                      f"load {json.dumps(bal)}", flush=True)
        summary = {"args": vars(args), "python": sys.version.split()[0],
                   "torch": __import__("torch").__version__, "configs": {}}
        lines = ["| config | rate (req/s) | achieved req/s | TTFT p50 ms | TTFT p99 ms | "
                 "SLO met | prompt-cache hit rate |", "|---|---|---|---|---|---|---|"]
        for name in names:
            best = max_qps_meeting_slo(entries[name], args.slo_target)
            summary["configs"][name] = {"max_qps_at_slo": best["request_throughput"]
                                        if best else 0.0, "rates": entries[name],
                                        "hit_rates": hit_rates[name],
                                        "balance": balance[name]}
            for e, h in zip(entries[name], hit_rates[name]):
                lines.append(f"| {name} | {e['request_rate']} | {e['request_throughput']:.2f} | "
                             f"{e['ttft_ms']['p50']:.0f} | {e['ttft_ms']['p99']:.0f} | "
                             f"{e['slo_attainment']:.0%} | {h:.0%} |")
        lines += ["", "| config | rate | routed per instance | mean in flight per instance | "
                  "max in flight | mean abs. in-flight diff | one idle, other >= 2 | "
                  "hit rate per instance | SLO misses (in first quarter) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name in names:
            for e, b in zip(entries[name], balance[name]):
                lines.append(f"| {name} | {e['request_rate']} | {b.get('routed', '-')} | "
                             f"{b.get('mean_in_flight', '-')} | {b.get('max_in_flight', '-')} | "
                             f"{b.get('mean_abs_diff', '-')} | "
                             f"{b.get('idle_while_other_2plus', '-')} | "
                             f"{b['hit_rate_per_instance']} | "
                             f"{b['misses']} ({b['misses_first_quarter']}) |")
        qps = {n: summary["configs"][n]["max_qps_at_slo"] for n in names}
        lines.append("")
        lines.append("max QPS at SLO (" + args.slo + f", {args.slo_target:.0%} of requests): "
                     + ", ".join(f"{n} {q:.2f}" for n, q in qps.items()))
        if qps["round_robin"] > 0:
            for n in names:
                if n.startswith("prefix_affinity"):
                    lines.append(f"{n} / round_robin = {qps[n] / qps['round_robin']:.2f}x")
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
