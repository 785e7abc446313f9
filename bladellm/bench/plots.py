"""TTFT-vs-QPS and TBT(ITL)-vs-QPS curves, one line per result file (server)."""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bladellm.bench.metrics import SLO, max_qps_meeting_slo  # noqa: E402

PLOTS = (
    # file name, metric key, y label, SLO field drawn as a horizontal line
    ("ttft_vs_qps.png", "ttft_ms", "TTFT (ms)", "ttft"),
    ("tbt_vs_qps.png", "itl_ms", "TBT / ITL (ms)", "tpot"),
)


def _points(run: dict[str, Any], key: str, stat: str) -> tuple[list[float], list[float]]:
    # In order of the offered rate, not of x: past saturation the achieved rate stalls (or dips)
    # while latency climbs, and the curve should show that hook rather than zigzag.
    pts = []
    for e in run["rates"]:
        y = (e.get(key) or {}).get(stat)
        if e.get("completed") and y is not None and not math.isnan(y):
            pts.append((float(e["request_rate"]), e["request_throughput"], y))
    pts.sort(key=lambda p: p[0])
    return [p[1] for p in pts], [p[2] for p in pts]


def plot_runs(runs: Sequence[dict[str, Any]], output_dir: str, stat: str = "mean",
              slo: SLO | None = None, slo_target: float = 0.9, prefix: str = "") -> list[str]:
    """Write the two PNGs to ``output_dir``; return their paths.

    x is the achieved request rate (req/s), so 'inf' rates land where the server saturated.
    Each run's max QPS meeting the SLO (>= ``slo_target`` of requests within every target) is
    starred and written into the legend."""
    os.makedirs(output_dir, exist_ok=True)
    paths = []
    for fname, key, ylabel, slo_field in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for run in runs:
            xs, ys = _points(run, key, stat)
            if not xs:
                continue
            label = run.get("label") or "run"
            best = max_qps_meeting_slo(run["rates"], slo_target)
            if best is not None:
                label += f" (max {best['request_throughput']:.2f} req/s in SLO)"
            (line,) = ax.plot(xs, ys, marker="o", label=label)
            if best is not None:
                by = (best.get(key) or {}).get(stat)
                if by is not None and not math.isnan(by):
                    ax.plot([best["request_throughput"]], [by], marker="*", markersize=16,
                            color=line.get_color(), markeredgecolor="black")
                ax.axvline(best["request_throughput"], color=line.get_color(), linestyle=":",
                           alpha=0.6)
        target = getattr(slo, slo_field, None) if slo is not None else None
        if target is not None:
            ax.axhline(target, color="red", linestyle="--", alpha=0.7,
                       label=f"SLO {slo_field.upper()} {target:g} ms")
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(f"{ylabel}, {stat}")
        ax.set_title(f"{ylabel.split(' (')[0]} vs QPS")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(output_dir, prefix + fname)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
