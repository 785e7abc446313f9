"""Pure functions from per-request results to a rate's summary. Times in, milliseconds out.

Definitions (the same as vLLM's and SGLang's serving benchmarks):
- TTFT: send -> first chunk with generated text.
- ITL: every gap between consecutive text chunks, pooled over all requests (the TBT curve).
- TPOT: per request, (E2E - TTFT) / (output_tokens - 1); requests with one token have none.
- E2E: send -> end of stream.
- goodput: successful requests meeting every SLO target, per second of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from bladellm.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}


@dataclass(frozen=True)
class SLO:
    """Targets in milliseconds; None means no target on that metric."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e))
                if v is not None}


def parse_slo(text: str | None) -> SLO:
    """'ttft:500,tpot:50' -> SLO(ttft=500, tpot=50); raises ValueError naming --slo."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        if not sep or key.strip().lower() not in SLO_KEYS:
            raise ValueError(f"--slo: expected KEY:MS with KEY in ttft,tpot,e2e, got {part!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key} needs a number of milliseconds, "
                             f"got {value!r}") from None
        # NaN compares false both ways: every request would "meet" it; inf is no target at all.
        if not (ms > 0 and math.isfinite(ms)):
            raise ValueError(f"--slo: {key} must be a finite number of ms > 0, got {value!r}")
        name = SLO_KEYS[key.strip().lower()]
        if name in values:  # 'ttft:500,ttft:100' (or e2e and e2el): one would silently win
            raise ValueError(f"--slo: {name} given twice in {text!r}")
        values[name] = ms
    return SLO(**values)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution(values_s: Iterable[float]) -> dict[str, float]:
    """Seconds -> {mean, p50, p90, p99} in milliseconds (NaN when empty)."""
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ms, p)
    return out


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None with fewer than two tokens."""
    if result.output_tokens < 2:
        return None
    return (result.e2e - result.ttft) / (result.output_tokens - 1)


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    if not result.success:
        return False
    if slo.ttft is not None and result.ttft * 1000.0 > slo.ttft:
        return False
    t = tpot(result)
    if slo.tpot is not None and t is not None and t * 1000.0 > slo.tpot:
        return False
    if slo.e2e is not None and result.e2e * 1000.0 > slo.e2e:
        return False
    return True


def summarize(results: Sequence[RequestResult], duration_s: float,
              slo: SLO = SLO()) -> dict:
    """One rate's summary: counts, throughputs, latency distributions (ms), goodput."""
    ok = [r for r in results if r.success]
    errors = [r for r in results if not r.success]
    duration_s = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": distribution(r.ttft for r in ok),
        "itl_ms": distribution(g for r in ok for g in r.itl),
        "tpot_ms": distribution(t for t in (tpot(r) for r in ok) if t is not None),
        "e2e_ms": distribution(r.e2e for r in ok),
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        "error_samples": sorted({r.error for r in errors})[:5],
    }
    classes = summarize_by_priority(results)
    if classes is not None:
        summary["priority_classes"] = classes
    if slo.is_set():
        good = sum(meets_slo(r, slo) for r in results)
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(results) if results else math.nan
    else:
        summary["goodput"] = None
        summary["slo_attainment"] = None
    return summary


def summarize_by_priority(results: Sequence[RequestResult]) -> dict[str, dict] | None:
    """Per ``--priority_mix`` class (keyed by the priority as text): request counts and the
    latencies a class's users see; None when the run had no classes."""
    classes = sorted({r.priority for r in results if r.priority is not None})
    if not classes:
        return None
    out = {}
    for prio in classes:
        mine = [r for r in results if r.priority == prio]
        ok = [r for r in mine if r.success]
        out[str(prio)] = {
            "num_requests": len(mine), "completed": len(ok),
            "ttft_ms": distribution(r.ttft for r in ok),
            "tpot_ms": distribution(t for t in (tpot(r) for r in ok) if t is not None),
            "e2e_ms": distribution(r.e2e for r in ok),
        }
    return out


def meets_slo_target(summary: dict, target: float) -> bool:
    """Whether a rate kept at least ``target`` of its requests within the SLO."""
    att = summary.get("slo_attainment")
    return att is not None and not math.isnan(att) and att >= target


def max_qps_meeting_slo(summaries: Sequence[dict], target: float) -> dict | None:
    """The rate with the highest achieved req/s among those meeting the SLO target."""
    passing = [s for s in summaries if meets_slo_target(s, target)]
    return max(passing, key=lambda s: s["request_throughput"], default=None)
