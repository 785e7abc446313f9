"""The tables of benchmarks/multimodal_serving.sh from its blade_llm_bench result files.

    python benchmarks/multimodal_report.py OUT_DIR

Each ratio is taken within one pass (a pass runs both sides back to back on one machine), so a
machine shared with other work moves both sides of a ratio alike; absolute numbers do not
carry between runs.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _entry(out: str, label: str) -> dict | None:
    path = os.path.join(out, f"{label}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)["rates"][0]


def _ttft(e: dict, stat: str = "mean") -> float:
    return e["ttft_ms"][stat]


def cache_table(out: str, prefix: str, title: str) -> list[str]:
    rows = [f"**{title}**", "",
            "| pass | TTFT mean, new images (ms) | TTFT mean, repeated image (ms) | "
            "ratio (repeated / new) | req/s new → repeated | prompt tokens per request |",
            "|---|---|---|---|---|---|"]
    passes = sorted({os.path.basename(p)[len(prefix) + len("-r0-"):-len(".json")]
                     for p in glob.glob(os.path.join(out, f"{prefix}-r0-*.json"))})
    for p in passes:
        new, rep = _entry(out, f"{prefix}-r0-{p}"), _entry(out, f"{prefix}-r1-{p}")
        if new is None or rep is None:
            continue
        rows.append(
            f"| {p} | {_ttft(new):.0f} | {_ttft(rep):.0f} | **{_ttft(rep) / _ttft(new):.2f}×** | "
            f"{new['request_throughput']:.2f} → {rep['request_throughput']:.2f} | "
            f"{new['total_input_tokens'] / max(new['completed'], 1):.0f} |")
    return rows + [""]


def pairs_line(out: str) -> list[str]:
    path = os.path.join(out, "pc-pairs.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        r = json.load(f)
    med, hit = r["median_ttft_s"], r["hit"]
    return [f"Interleaved (miss, hit) pairs, {len(hit)} of each: median TTFT miss "
            f"{med['miss'] * 1e3:.0f} ms, hit {med['hit'] * 1e3:.0f} ms, **{r['ratio']:.2f}×**; "
            f"a hit reads {hit[0]['cached_tokens']} of {hit[0]['prompt_tokens']} prompt tokens "
            f"from the prompt cache.", ""]


def versus_table(out: str) -> list[str]:
    rows = ["**bladellm vs vLLM-CPU (rate inf, every image new)**", "",
            "| round | bladellm req/s | vLLM-CPU req/s | ratio | bladellm TTFT mean / p90 (ms) "
            "| vLLM-CPU TTFT mean / p90 (ms) | TTFT ratio (mean) | prompt tokens per request "
            "(bladellm / vLLM) |",
            "|---|---|---|---|---|---|---|---|"]
    round_ = 1
    while True:
        b, v = _entry(out, f"vs-bladellm-{round_}"), _entry(out, f"vs-vllm-{round_}")
        if b is None and v is None:
            break
        if b is not None and v is not None:
            rows.append(
                f"| {round_} | {b['request_throughput']:.2f} | {v['request_throughput']:.2f} | "
                f"**{b['request_throughput'] / v['request_throughput']:.2f}×** | "
                f"{_ttft(b):.0f} / {_ttft(b, 'p90'):.0f} | "
                f"{_ttft(v):.0f} / {_ttft(v, 'p90'):.0f} | "
                f"{_ttft(b) / _ttft(v):.2f} | "
                f"{b['total_input_tokens'] / max(b['completed'], 1):.0f} / "
                f"{v['total_input_tokens'] / max(v['completed'], 1):.0f} |")
        round_ += 1
    return rows + [""]


def main() -> None:
    out = sys.argv[1]
    lines = cache_table(out, "enc", "Encoder cache: --disable_prompt_cache, requests in flight "
                                    "share an image's encoder output")
    lines += cache_table(out, "pc", "Image-aware prompt cache: one request at a time, default "
                                    "flags (a repeated image hits the cached blocks)")
    lines += pairs_line(out)
    lines += versus_table(out)
    errors = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path, encoding="utf-8") as f:
            rates = json.load(f).get("rates")  # pc-pairs.json has none
        if rates and rates[0]["errors"]:
            errors.append(f"{os.path.basename(path)}: {rates[0]['errors']} errors")
    lines += errors or ["(no failed requests)"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
