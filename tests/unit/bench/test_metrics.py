"""Metrics on synthetic streams whose timings are known exactly."""

import math

import pytest

from bladellm.bench.client import StreamRecorder
from bladellm.bench.metrics import (SLO, max_qps_meeting_slo, meets_slo, parse_slo, percentile,
                                    summarize, tpot)


def _stream(start, ttft, gaps, usage_tokens=None, prompt_len=10, chat=False):
    """Drive a StreamRecorder with events at known times; returns the finished result."""
    rec = StreamRecorder(start, prompt_len)
    t = start
    if chat:
        rec.on_event('{"choices":[{"delta":{"role":"assistant"}}]}', start + 0.001)
    t = start + ttft
    key = '{"choices":[{"delta":{"content":"x"}}]}' if chat else '{"choices":[{"text":"x"}]}'
    rec.on_event(key, t)
    for g in gaps:
        t += g
        rec.on_event(key, t)
    if usage_tokens is not None:
        rec.on_event('{"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}'
                     % (prompt_len + 1, usage_tokens), t)
    rec.on_event("[DONE]", t)
    return rec.finish(t)


def test_ttft_itl_tpot_e2e_from_known_stream():
    r = _stream(100.0, 0.25, [0.01, 0.02, 0.03])
    assert r.success
    assert r.ttft == pytest.approx(0.25)
    assert r.itl == pytest.approx([0.01, 0.02, 0.03])
    assert r.e2e == pytest.approx(0.31)
    assert r.output_tokens == 4  # counted chunks: no usage reported
    assert not r.usage_reported
    assert tpot(r) == pytest.approx(0.06 / 3)


def test_role_chunk_does_not_count_as_first_token():
    r = _stream(0.0, 0.2, [0.05], chat=True)
    assert r.ttft == pytest.approx(0.2)
    assert r.output_tokens == 2


def test_usage_overrides_chunk_count():
    # A server that packs several tokens into a chunk: usage is the truth for TPOT.
    r = _stream(0.0, 0.1, [0.1, 0.1], usage_tokens=9, prompt_len=5)
    assert r.usage_reported
    assert r.output_tokens == 9 and r.prompt_tokens == 6
    assert tpot(r) == pytest.approx(0.2 / 8)


def test_error_event_fails_request():
    rec = StreamRecorder(0.0, 3)
    rec.on_event('{"choices":[{"text":"a"}]}', 0.1)
    rec.on_event('{"error":{"message":"boom"}}', 0.2)
    r = rec.finish(0.3)
    assert not r.success and r.error == "boom"


def test_empty_stream_is_an_error():
    rec = StreamRecorder(0.0, 3)
    rec.on_event("[DONE]", 0.1)
    assert not rec.finish(0.1).success


def test_percentile_matches_linear_interpolation():
    xs = list(range(1, 101))  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summary_distributions_throughput_and_goodput():
    # 10 requests: TTFT 100..1000 ms, 5 tokens each with 10 ms gaps; one failed request.
    results = [_stream(float(i), 0.1 * (i + 1), [0.01] * 4) for i in range(10)]
    failed = _stream(0.0, 0.1, [])
    failed.success, failed.error = False, "HTTP 500"
    s = summarize(results + [failed], duration_s=5.0, slo=SLO(ttft=500, tpot=20))
    assert s["completed"] == 10 and s["errors"] == 1
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(50 / 5.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(550)
    assert s["ttft_ms"]["p50"] == pytest.approx(550)
    assert s["ttft_ms"]["p90"] == pytest.approx(910)
    assert s["ttft_ms"]["p99"] == pytest.approx(991)
    assert s["itl_ms"]["p50"] == pytest.approx(10) and s["itl_ms"]["p99"] == pytest.approx(10)
    assert s["tpot_ms"]["mean"] == pytest.approx(10)
    # TTFT <= 500 ms: requests 0..4 -> 5 good of 11, over 5 s.
    assert s["goodput"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(5 / 11)
    assert s["error_samples"] == ["HTTP 500"]


def test_goodput_tpot_target():
    fast = _stream(0.0, 0.1, [0.01] * 4)
    slow = _stream(0.0, 0.1, [0.05] * 4)
    assert meets_slo(fast, SLO(tpot=20)) and not meets_slo(slow, SLO(tpot=20))
    assert meets_slo(slow, SLO(e2e=400)) and not meets_slo(slow, SLO(e2e=250))


def test_no_slo_means_no_goodput():
    s = summarize([_stream(0.0, 0.1, [0.01])], 1.0)
    assert s["goodput"] is None and s["slo_attainment"] is None


def test_parse_slo():
    assert parse_slo("ttft:500,tpot:50") == SLO(ttft=500, tpot=50)
    assert parse_slo("e2el:2000").e2e == 2000
    for bad in ("ttft", "foo:1", "ttft:x", "ttft:-1", "ttft:nan", "tpot:inf", "e2e:1,e2el:2"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_max_qps_meeting_slo_picks_highest_passing_rate():
    rates = [{"request_throughput": 1.0, "slo_attainment": 1.0},
             {"request_throughput": 2.0, "slo_attainment": 0.95},
             {"request_throughput": 3.5, "slo_attainment": 0.5}]
    assert max_qps_meeting_slo(rates, 0.9)["request_throughput"] == 2.0
    assert max_qps_meeting_slo(rates, 0.99)["request_throughput"] == 1.0
    assert max_qps_meeting_slo(rates[2:], 0.9) is None


def test_empty_text_token_chunks_are_counted_without_usage():
    # llama.cpp: one chunk per token, partial-UTF-8 tokens with text "", no usage chunk.
    rec = StreamRecorder(0.0, 3)
    for t, text in [(0.1, "a"), (0.2, ""), (0.3, "b")]:
        rec.on_event('{"choices":[{"text":"%s","finish_reason":null}]}' % text, t)
    rec.on_event('{"choices":[{"text":"","finish_reason":"length"}]}', 0.3)
    r = rec.finish(0.3)
    assert r.output_tokens == 3
    assert r.itl == pytest.approx([0.2])  # gaps between chunks a user sees
    assert tpot(r) == pytest.approx(0.1)
