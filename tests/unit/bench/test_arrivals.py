"""Arrival schedules: Poisson statistics, gamma burstiness, and that the runner keeps them."""

import asyncio
import random
import statistics

import pytest

from bladellm.bench.datasets import BenchRequest
from bladellm.bench.runner import arrival_intervals, parse_rates, run_schedule


def _cv(xs):
    return statistics.pstdev(xs) / statistics.fmean(xs)


def test_poisson_mean_rate_and_cv():
    gaps = arrival_intervals(20001, rate=4.0, burstiness=1.0, rng=random.Random(1))[1:]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("burstiness,cv", [(0.25, 2.0), (4.0, 0.5)])
def test_burstiness_changes_cv_not_rate(burstiness, cv):
    gaps = arrival_intervals(20001, rate=4.0, burstiness=burstiness, rng=random.Random(2))[1:]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert _cv(gaps) == pytest.approx(cv, rel=0.08)


def test_inf_rate_sends_at_once_and_seed_repeats():
    assert arrival_intervals(5, float("inf")) == [0.0] * 5
    a = arrival_intervals(50, 3.0, rng=random.Random(7))
    assert a == arrival_intervals(50, 3.0, rng=random.Random(7)) and a[0] == 0.0


def test_parse_rates():
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, float("inf")]
    for bad in ("", "0", "x", "-1", "nan", "1,NaN"):
        with pytest.raises(ValueError, match="--request_rate"):
            parse_rates(bad)


def test_run_schedule_follows_arrivals_and_caps_concurrency():
    reqs = [BenchRequest("p", 1, 1) for _ in range(6)]
    gaps = [0.0, 0.05, 0.05, 0.05, 0.05, 0.05]
    sent, in_flight, peak = [], [0], [0]

    async def send(req):
        sent.append(asyncio.get_running_loop().time())
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.12)
        in_flight[0] -= 1
        return req

    results, duration = asyncio.run(run_schedule(reqs, gaps, send))
    assert len(results) == 6
    offsets = [t - sent[0] for t in sent]
    assert offsets == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.25], abs=0.03)
    assert duration == pytest.approx(0.37, abs=0.06)
    assert peak[0] >= 3

    sent.clear(), peak.__setitem__(0, 0)
    asyncio.run(run_schedule(reqs, [0.0] * 6, send, max_concurrency=2))
    assert peak[0] == 2
