"""TTFT-vs-QPS and TBT(ITL)-vs-QPS curves, one line per result file (server).

TTFT is drawn on a log axis: below saturation it is a few hundred ms, past it seconds, and a
linear axis flattens the part of the curve where the SLO is decided. TBT stays linear unless
its points span more than ``LOG_SPAN`` (one decade)."""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter  # noqa: E402

from bladellm.bench.metrics import SLO, max_qps_meeting_slo  # noqa: E402

PLOTS = (
    # file name, metric key, y label, SLO field drawn as a horizontal line, y scale
    # ("log", or "auto": log only when the points span more than LOG_SPAN)
    ("ttft_vs_qps.png", "ttft_ms", "TTFT (ms)", "ttft", "log"),
    ("tbt_vs_qps.png", "itl_ms", "TBT / ITL (ms)", "tpot", "auto"),
)
LOG_SPAN = 10.0


def y_scale(scale: str, ys: Sequence[float]) -> str:
    """The y axis scale ("log" or "linear") for a plot's points; a log axis needs positive ones."""
    pos = [y for y in ys if y > 0]
    if not pos:
        return "linear"
    if scale == "log":
        return "log"
    return "log" if max(pos) / min(pos) > LOG_SPAN else "linear"


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


def make_figures(runs: Sequence[dict[str, Any]], stat: str = "mean", slo: SLO | None = None,
                 slo_target: float = 0.9) -> list[tuple[str, Any]]:
    """The two figures, as (file name, matplotlib Figure); the caller saves and closes them.

    x is the achieved request rate (req/s), so 'inf' rates land where the server saturated.
    Each run's max QPS meeting the SLO (>= ``slo_target`` of requests within every target) is
    starred and written into the legend."""
    figs = []
    for fname, key, ylabel, slo_field, scale in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        all_ys: list[float] = []
        for run in runs:
            xs, ys = _points(run, key, stat)
            if not xs:
                continue
            all_ys += ys
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
        log = y_scale(scale, all_ys) == "log"
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(f"{ylabel}, {stat}" + (", log scale" if log else ""))
        ax.set_title(f"{ylabel.split(' (')[0]} vs QPS")
        ax.grid(True, which="both" if log else "major", alpha=0.3)
        if log:
            ax.set_yscale("log")
            # Plain numbers (50, 100, 2000), not powers of ten.
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False,
                                                      minor_thresholds=(1.5, 0.5)))
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        figs.append((fname, fig))
    return figs


def plot_runs(runs: Sequence[dict[str, Any]], output_dir: str, stat: str = "mean",
              slo: SLO | None = None, slo_target: float = 0.9, prefix: str = "") -> list[str]:
    """Write the two PNGs (see ``make_figures``) to ``output_dir``; return their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = []
    for fname, fig in make_figures(runs, stat, slo, slo_target):
        path = os.path.join(output_dir, prefix + fname)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
