"""A declined sps draft is said at start-up and counted in /metrics with its reason (issue 37
item 7: with the default cost rule the draft never ran and nothing said so)."""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_spec_cost import COSTS, SPS, _decoding, _sched  # noqa: E402

from bladellm.core.spec_decode import SpecCosts  # noqa: E402
from bladellm.engine.engine_core import _log_draft_outlook  # noqa: E402
from bladellm.entrypoints.openai.metrics import PrometheusStatLogger  # noqa: E402
from bladellm.request import Request  # noqa: E402
from bladellm.sampling_params import SamplingParams  # noqa: E402


def _declined(sched) -> dict[str, int]:
    return sched.get_stats().num_spec_declined


def test_declined_drafts_are_counted_by_reason():
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.37))
    _decoding(sched, 16, chain=3)  # their prefill step declined the draft too
    before = _declined(sched)["cost"]
    assert sched.schedule().spec_propose == set()
    assert _declined(sched) == {"cost": before + 16, "length": 0} and before == 16
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.05))
    sched.add_request(Request("a", list(range(1, 9)), SamplingParams(max_tokens=2)))
    sched.schedule()
    assert _declined(sched) == {"cost": 0, "length": 1}


def test_break_even_rate_matches_the_rule():
    """The start-up number is the rule's own: just above it a lone caught-up request gets the
    draft, just below it does not."""
    for ratio in (0.05, 0.2, 0.37):
        sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=ratio))
        p = sched.spec_policy.draft_break_even()
        assert p == pytest.approx(1 / (COSTS["step_overhead"] + 1) + ratio)
        for rate, runs in ((p - 0.02, False), (p + 0.02, True)):
            sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=ratio))
            (req,) = _decoding(sched, 1)
            req.spec_stats.ev_proposed, req.spec_stats.ev_accepted = 1e6, rate * 1e6
            req.spec_stats.draft_known = req.num_tokens
            req.max_tokens = 10_000
            if rate > 1:
                continue
            assert (sched.schedule().spec_propose == {"r0"}) == runs, (ratio, rate)


@pytest.mark.parametrize("rate,level,words", [
    (1.2, logging.WARNING, "never run"), (0.7, logging.WARNING, "more than 70%"),
    (0.2, logging.INFO, "more than 20%")])
def test_startup_outlook(caplog, rate, level, words):
    with caplog.at_level(logging.INFO):
        _log_draft_outlook(rate)
    (record,) = caplog.records
    assert record.levelno == level and words in record.getMessage()


def test_metrics_count_declined_drafts():
    sched = _sched(SPS, SpecCosts(**COSTS, draft_ratio=0.37))
    _decoding(sched, 4, chain=3)
    metrics = PrometheusStatLogger(model_name="m")
    metrics.update_scheduler_stats(sched.get_stats())  # the prefill step: 4 declined
    sched.schedule()
    metrics.update_scheduler_stats(sched.get_stats())  # 4 more
    text = metrics.render().decode()
    assert 'bladellm_spec_decode_declined_total{reason="cost"} 8.0' in text
    assert 'bladellm_spec_decode_declined_total{reason="length"} 0.0' in text
