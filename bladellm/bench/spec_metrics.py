"""Speculative-decoding acceptance from the server's Prometheus ``/metrics``.

Servers that speculate (BladeLLM with ``--decode_algo sps`` or ``look_ahead``, vLLM) expose
running totals under vLLM's names:

- ``vllm:spec_decode_num_drafts``: request-steps that verified proposed tokens;
- ``vllm:spec_decode_num_draft_tokens``: proposed tokens verified;
- ``vllm:spec_decode_num_accepted_tokens``: proposed tokens accepted.

BladeLLM also spells them ``bladellm_spec_decode_...`` (``--metrics_names``). Counters appear in
the text format with a ``_total`` suffix; samples of one name with different labels (model,
engine) are summed. The benchmark scrapes before and after each rate and reports the growth:

- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts (vLLM's definition: tokens emitted per
  verifying step, the bonus token included).

A server without these counters (or without ``/metrics``) gives ``None``: no columns, not zeros.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp

PREFIXES = ("vllm:", "bladellm_")  # the first one a server exposes wins; never both (no double
# counting when BladeLLM publishes both spellings)
COUNTERS = {"num_drafts": "spec_decode_num_drafts",
            "num_draft_tokens": "spec_decode_num_draft_tokens",
            "num_accepted_tokens": "spec_decode_num_accepted_tokens"}
REQUIRED = ("num_draft_tokens", "num_accepted_tokens")
SCRAPE_TIMEOUT_S = 10.0


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Sample name -> the sum of its values over all label sets (Prometheus text format)."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = _first_space(line)
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            end = _closing_brace(line, brace)
            if end < 0:
                continue
            rest = line[end + 1:].split()
        else:
            if space < 0:
                continue
            name, rest = line[:space], line[space:].split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _first_space(line: str) -> int:
    for i, c in enumerate(line):
        if c in " \t":
            return i
    return -1


def _closing_brace(line: str, start: int) -> int:
    """Index of the ``}`` closing the label set at ``start``; label values may hold ``}``,
    spaces and escaped quotes."""
    in_str = False
    i = start + 1
    while i < len(line):
        c = line[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "}":
            return i
        i += 1
    return -1


def spec_counters(text: str) -> dict[str, Any] | None:
    """The speculative-decoding totals in a ``/metrics`` page, or None when it has none.

    ``num_drafts`` may be None (older vLLM exposes only the token counters)."""
    samples = parse_prometheus_text(text)
    for prefix in PREFIXES:
        found: dict[str, Any] = {}
        for key, base in COUNTERS.items():
            name = prefix + base
            found[key] = next((samples[n] for n in (name + "_total", name) if n in samples),
                              None)
        if all(found[k] is not None for k in REQUIRED):
            found["source"] = prefix + "spec_decode_*"
            return found
    return None


def spec_delta(before: dict[str, Any] | None,
               after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What one rate's run added to the totals, with its acceptance rate and mean acceptance
    length (None where there was nothing to divide by). None when either scrape had no
    counters, they came from different spellings, or a total went down (server restarted)."""
    if before is None or after is None or before.get("source") != after.get("source"):
        return None
    out: dict[str, Any] = {"source": after.get("source")}
    for key in COUNTERS:
        a, b = after.get(key), before.get(key)
        if a is None or b is None:
            out[key] = None
            continue
        if a < b:
            return None
        out[key] = int(round(a - b))
    drafts, draft_tokens, accepted = (out["num_drafts"], out["num_draft_tokens"],
                                      out["num_accepted_tokens"])
    out["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
    out["mean_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    return out


async def scrape_spec_counters(session: aiohttp.ClientSession,
                               base_url: str) -> dict[str, Any] | None:
    """GET ``/metrics`` and read the totals; None on any failure (no endpoint, not Prometheus
    text, no speculative counters). Never raises: a benchmark must not fail over it."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text(errors="replace")
    except Exception:  # noqa: BLE001 - optional information
        return None
    return spec_counters(text)


def has_spec(entry: dict[str, Any]) -> bool:
    """Whether a rate entry carries a measured acceptance (columns are shown only then)."""
    spec = entry.get("spec_decode") or {}
    return (spec.get("acceptance_rate") is not None
            or spec.get("mean_acceptance_length") is not None)
