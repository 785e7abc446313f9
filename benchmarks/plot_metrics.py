"""Draw the /metrics series scraped by ``benchmarks/reliability.py`` as dashboard-like panels.

    python benchmarks/plot_metrics.py bench_results/reliability/metrics_series.json docs/img/x.png

The panels mirror docs/grafana/bladellm-vllm-dashboard.json (same vllm:* series, same
derivations: rates over a window, mean latency = rate(sum) / rate(count)), drawn with
matplotlib from the scraped samples: a rendering of real data, not a Grafana screenshot.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

WINDOW = 4  # samples (0.5 s apart) per rate window


def _rate(series: list[dict], key: str) -> tuple[list[float], list[float]]:
    t, v = [], []
    for a, b in zip(series, series[WINDOW:]):
        if key in a and key in b and b["t"] > a["t"]:
            t.append(b["t"])
            v.append(max(0.0, b[key] - a[key]) / (b["t"] - a["t"]))
    return t, v


def _mean(series: list[dict], base: str) -> tuple[list[float], list[float]]:
    t, v = [], []
    for a, b in zip(series, series[WINDOW:]):
        dc = b.get(f"{base}_count", 0) - a.get(f"{base}_count", 0)
        if dc > 0:
            t.append(b["t"])
            v.append((b[f"{base}_sum"] - a[f"{base}_sum"]) / dc * 1000)
    return t, v


def main(src: str, dst: str, title: str = "") -> None:
    series = json.load(open(src))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    t = [s["t"] for s in series]
    ax = axes[0][0]
    ax.plot(t, [s.get("vllm:num_requests_running", 0) for s in series], label="running")
    ax.plot(t, [s.get("vllm:num_requests_waiting", 0) for s in series], label="waiting")
    ax.set_title("Scheduler state\nvllm:num_requests_running / _waiting")
    ax.legend()
    ax = axes[0][1]
    ax.plot(t, [100 * s.get("vllm:kv_cache_usage_perc", 0) for s in series])
    ax.set_title("KV-cache usage (%)\nvllm:kv_cache_usage_perc")
    ax = axes[0][2]
    ax.plot(*_rate(series, "vllm:generation_tokens_total"), label="generation")
    ax.plot(*_rate(series, "vllm:prompt_tokens_total"), label="prompt")
    ax.set_title("Token throughput (tokens/s)\nrate(vllm:*_tokens_total)")
    ax.legend()
    ax = axes[1][0]
    ax.plot(*_mean(series, "vllm:time_to_first_token_seconds"))
    ax.set_title("Mean time to first token (ms)\nvllm:time_to_first_token_seconds")
    ax = axes[1][1]
    ax.plot(*_mean(series, "vllm:inter_token_latency_seconds"))
    ax.set_title("Mean inter-token latency (ms)\nvllm:inter_token_latency_seconds")
    ax = axes[1][2]
    phases, starts = [], []
    for s in series:
        if not phases or phases[-1] != s["phase"]:
            phases.append(s["phase"])
            starts.append(s["t"])
    for a in [a for row in axes for a in row if a is not axes[1][2]]:
        a.set_xlabel("seconds since start")
        for x in starts[1:]:
            a.axvline(x, color="grey", lw=0.6, ls=":")
    axes[1][2].axis("off")
    axes[1][2].text(0, 0.95, "Phases (dotted lines):\n" + "\n".join(
        f"  {p} from {x:.0f} s" for p, x in zip(phases, starts)), va="top", family="monospace")
    fig.suptitle(title or "BladeLLM /metrics during benchmarks/reliability.py (matplotlib "
                          "rendering of scraped vllm:* series, not a Grafana screenshot)")
    fig.tight_layout()
    fig.savefig(dst, dpi=80)


if __name__ == "__main__":
    main(*sys.argv[1:])
