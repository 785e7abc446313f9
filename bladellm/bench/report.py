"""Result files (JSON, CSV) and the terminal table."""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict
from typing import Any, Sequence

from bladellm.bench.client import RequestResult
from bladellm.bench.metrics import SLO, max_qps_meeting_slo, summarize
from bladellm.bench.spec_metrics import has_spec

DIST_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
STATS = ("mean", "p50", "p90", "p99")
SCALAR_KEYS = ("completed", "errors", "duration_s", "request_throughput", "output_throughput",
               "total_token_throughput", "total_input_tokens", "total_output_tokens",
               "goodput", "slo_attainment")
SPEC_KEYS = ("acceptance_rate", "mean_acceptance_length", "num_drafts", "num_draft_tokens",
             "num_accepted_tokens")


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_entry(rate: float, results: Sequence[RequestResult], duration_s: float,
               slo: SLO, spec_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rate's record in the JSON file: its summary plus every request's raw timings
    (so that `plot --slo` can re-judge goodput without re-running).

    ``spec_decode`` (``runner.RunResult.spec_decode``) is what the server's /metrics said about
    speculative decoding during the rate; it is stored under that key only when the server
    exposes the counters."""
    entry = {"request_rate": rate_name(rate)}
    entry.update(summarize(results, duration_s, slo))
    if spec_decode is not None:
        entry["spec_decode"] = dict(spec_decode)
    entry["requests"] = [_request_record(r) for r in results]
    return entry


def _request_record(r: RequestResult) -> dict[str, Any]:
    d = asdict(r)
    d.pop("num_chunks")
    d.pop("generated_text")  # only for counting tokens; it would bloat the file
    d["start"] = round(d["start"], 6)
    return d


def results_from_entry(entry: dict[str, Any]) -> list[RequestResult]:
    out = []
    for d in entry.get("requests", []):
        r = RequestResult(**{k: v for k, v in d.items() if k in RequestResult.__dataclass_fields__})
        r.num_chunks = len(r.itl) + (1 if r.success else 0)
        out.append(r)
    return out


def resummarize(entry: dict[str, Any], slo: SLO) -> dict[str, Any]:
    """The entry with its summary recomputed under another SLO."""
    new = dict(entry)
    new.update(summarize(results_from_entry(entry), entry["duration_s"], slo))
    return new


def _clean(o: Any) -> Any:
    # json.dump writes NaN literally (not valid JSON); store null instead.
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    return o


def write_json(path: str, run: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(run), f, indent=1)


def load_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    if "rates" not in run:
        raise ValueError(f"{path}: not a blade_llm_bench result file (no 'rates')")
    return run


def flat_row(entry: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"request_rate": entry["request_rate"]}
    for key in SCALAR_KEYS:
        row[key] = entry.get(key)
    for key in DIST_KEYS:
        for stat in STATS:
            row[f"{key[:-3]}_{stat}_ms"] = (entry.get(key) or {}).get(stat)
    if entry.get("spec_decode") is not None:
        for key in SPEC_KEYS:
            row[f"spec_{key}"] = entry["spec_decode"].get(key)
    for prio, cls in (entry.get("priority_classes") or {}).items():
        row[f"prio{prio}_completed"] = cls["completed"]
        for key in ("ttft_ms", "e2e_ms"):
            for stat in STATS:
                row[f"prio{prio}_{key[:-3]}_{stat}_ms"] = cls[key].get(stat)
    return row


def write_csv(path: str, run: dict[str, Any]) -> None:
    rows = [flat_row(e) for e in run["rates"]]
    if not rows:
        return
    fields: dict[str, None] = {}
    for row in rows:  # spec columns exist only for rates whose server reported them
        fields.update(dict.fromkeys(row))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _dist(entry: dict[str, Any], key: str, stats: Sequence[str], sep: str = "/") -> str:
    """Some statistics of one latency distribution of a rate entry, e.g. "12.0/11.5/20.1"."""
    return sep.join(_fmt((entry.get(key) or {}).get(s)) for s in stats)


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _spec_cells(entry: dict[str, Any]) -> list[str]:
    """Draft acceptance (accepted / draft tokens) and mean acceptance length
    (1 + accepted / drafts) of a rate; "-" where the server reported nothing."""
    spec = entry.get("spec_decode") or {}
    return [_pct(spec.get("acceptance_rate")), _fmt(spec.get("mean_acceptance_length"), 2)]


def format_table(run: dict[str, Any]) -> str:
    """Fixed-width summary: one row per rate. Latencies in ms as mean/p50/p90/p99. The
    speculative-decoding columns appear only when the server reported acceptance."""
    spec = any(has_spec(e) for e in run["rates"])
    cols = [("rate", 6), ("req/s", 7), ("out tok/s", 9), ("TTFT mean/p50/p90/p99", 27),
            ("ITL mean/p50/p90/p99", 25), ("TPOT mean/p99", 14), ("E2E p50/p99", 15),
            ("goodput", 7), ("err", 4)]
    if spec:
        cols += [("accept", 6), ("acc len", 7)]
    header = "  ".join(name.rjust(w) for name, w in cols)
    slo = ",".join(f"{k}:{v:g}" for k, v in (run.get("slo") or {}).items()) or "-"
    lines = [f"{run.get('label', '')}  endpoint={run.get('endpoint', '')}  "
             f"dataset={run.get('dataset', '')}  slo(ms)={slo}  latencies in ms", header,
             "-" * len(header)]
    for e in run["rates"]:
        cells = [e["request_rate"], _fmt(e["request_throughput"], 2),
                 _fmt(e["output_throughput"], 1), _dist(e, "ttft_ms", STATS),
                 _dist(e, "itl_ms", STATS), _dist(e, "tpot_ms", ("mean", "p99")),
                 _dist(e, "e2e_ms", ("p50", "p99")), _fmt(e.get("goodput"), 2), str(e["errors"])]
        if spec:
            cells += _spec_cells(e)
        lines.append("  ".join(str(c).rjust(w) for c, (_, w) in zip(cells, cols)))
    if spec:
        lines.append("accept = draft tokens accepted / draft tokens verified; acc len = mean "
                     "acceptance length, 1 + accepted / drafts (tokens per verifying step), "
                     "from the server's /metrics")
    for e in run["rates"]:
        for prio, cls in (e.get("priority_classes") or {}).items():
            lines.append(f"rate {e['request_rate']} priority {prio}: {cls['completed']}/"
                         f"{cls['num_requests']} ok, TTFT mean/p50/p90/p99 "
                         f"{_dist(cls, 'ttft_ms', STATS)}, E2E p50/p99 "
                         f"{_dist(cls, 'e2e_ms', ('p50', 'p99'))}")
    return "\n".join(lines)


def format_markdown_comparison(runs: Sequence[dict[str, Any]], slo_target: float = 0.9) -> str:
    """One Markdown table over several runs (servers), rows grouped by request rate, plus each
    run's highest achieved req/s meeting the SLO. Rates keep the order they first appear in."""
    spec = any(has_spec(e) for run in runs for e in run["rates"])
    lines = ["| rate | server | req/s | out tok/s | TTFT mean / p50 / p99 ms "
             "| TBT mean / p50 / p99 ms | TPOT mean ms | goodput req/s | errors |"
             + (" draft acceptance | mean acceptance length |" if spec else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if spec else "")]
    by_rate: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for run in runs:
        for e in run["rates"]:
            by_rate.setdefault(e["request_rate"], []).append((run.get("label", ""), e))
    three = ("mean", "p50", "p99")
    for rate, entries in by_rate.items():
        for label, e in entries:
            cells = [rate, label, _fmt(e["request_throughput"], 2),
                     _fmt(e["output_throughput"], 1), _dist(e, "ttft_ms", three, " / "),
                     _dist(e, "itl_ms", three, " / "), _dist(e, "tpot_ms", ("mean",)),
                     _fmt(e.get("goodput"), 2), str(e["errors"])]
            if spec:
                cells += _spec_cells(e)
            lines.append("| " + " | ".join(cells) + " |")
    best = []
    for run in runs:
        b = max_qps_meeting_slo(run["rates"], slo_target)
        best.append(f"{run.get('label', '')} "
                    + (f"{b['request_throughput']:.2f} req/s" if b else "none"))
    lines += ["", f"Highest achieved rate with {slo_target:.0%} of requests meeting the SLO: "
              + ", ".join(best) + "."]
    lines += _priority_class_table(by_rate)
    if spec:
        lines += ["", "Draft acceptance: proposed tokens accepted / proposed tokens verified; "
                  "mean acceptance length: 1 + accepted / drafts (tokens emitted per verifying "
                  "step), from each server's /metrics over the rate's run (\"-\": not "
                  "reported)."]
    return "\n".join(lines)


def _priority_class_table(by_rate: dict[str, list[tuple[str, dict[str, Any]]]]) -> list[str]:
    """TTFT and E2E per ``--priority_mix`` class, one row per rate, server and class; nothing
    when no run had classes."""
    rows = []
    three = ("mean", "p50", "p99")
    for rate, entries in by_rate.items():
        for label, e in entries:
            for prio, cls in (e.get("priority_classes") or {}).items():
                rows.append(f"| {rate} | {label} | {prio} | {cls['completed']} | "
                            f"{_dist(cls, 'ttft_ms', three, ' / ')} | "
                            f"{_dist(cls, 'e2e_ms', ('p50', 'p99'), ' / ')} |")
    if not rows:
        return []
    return ["", "| rate | server | priority | requests | TTFT mean / p50 / p99 ms "
            "| E2E p50 / p99 ms |", "|---|---|---|---|---|---|", *rows]
