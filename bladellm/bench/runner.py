"""Arrival schedules and the request-rate sweep."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import aiohttp
from tqdm import tqdm

from bladellm.bench.client import RequestOptions, RequestResult, send_request
from bladellm.bench.datasets import BenchRequest
from bladellm.bench.spec_metrics import scrape_spec_counters, spec_delta

SendFn = Callable[[BenchRequest], Awaitable[RequestResult]]


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; raises ValueError naming --request_rate."""
    rates = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:
            raise ValueError(f"--request_rate: not a number: {part!r}") from None
        # 'nan' parses as a float and passes `<= 0`; its gaps were NaN, so it ran like inf.
        if math.isnan(rate):
            raise ValueError(f"--request_rate: not a number: {part!r}")
        if rate <= 0:
            raise ValueError(f"--request_rate: rates must be > 0, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request_rate: give at least one rate")
    return rates


def arrival_intervals(num: int, rate: float, burstiness: float = 1.0,
                      rng: random.Random | None = None) -> list[float]:
    """Gaps (s) between consecutive arrivals: gamma(shape=burstiness, mean=1/rate).

    burstiness 1 is a Poisson process (exponential gaps, CV 1); below 1 burstier
    (CV = 1/sqrt(burstiness) > 1), above 1 more regular. rate inf sends everything at once.
    The first request goes at t=0."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(rate) or num == 0:
        return [0.0] * num
    rng = rng or random.Random()
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(num - 1)]


@dataclass
class RunResult:
    rate: float
    results: list[RequestResult]
    duration_s: float
    spec_decode: dict | None = None


@dataclass
class SweepConfig:
    base_url: str
    options: RequestOptions
    max_concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    request_timeout_s: float = 3600.0
    show_progress: bool = True
    scrape_metrics: bool = True  # read spec-decode counters from /metrics around each rate


async def run_schedule(requests: Sequence[BenchRequest], intervals: Sequence[float],
                       send: SendFn, max_concurrency: int | None = None,
                       progress: tqdm | None = None) -> tuple[list[RequestResult], float]:
    """Launch each request at its arrival time (absolute, so slow launches don't drift the
    schedule); with max_concurrency, an arrived request waits for a free slot before sending.
    Returns results in request order and the wall time from first arrival to last completion."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send(req)
        else:
            async with sem:
                res = await send(req)
        if progress is not None:
            progress.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    at = 0.0
    for req, gap in zip(requests, intervals):
        at += gap
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


def make_session(cfg: SweepConfig) -> aiohttp.ClientSession:
    # limit=0: no client-side connection cap; concurrency is the schedule's business.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


async def warm_up(cfg: SweepConfig, requests: Sequence[BenchRequest]) -> list[RequestResult]:
    """Send the warm-up requests (concurrently, within max_concurrency); results are dropped
    by the caller except to warn when all failed."""
    if not requests:
        return []
    async with make_session(cfg) as session:
        results, _ = await run_schedule(
            requests, [0.0] * len(requests),
            lambda r: send_request(session, cfg.base_url, r, cfg.options), cfg.max_concurrency)
    return results


async def run_rate(cfg: SweepConfig, rate: float, requests: Sequence[BenchRequest],
                   rng: random.Random) -> RunResult:
    intervals = arrival_intervals(len(requests), rate, cfg.burstiness, rng)
    label = "inf" if math.isinf(rate) else f"{rate:g}"
    with tqdm(total=len(requests), desc=f"rate={label} req/s", unit="req",
              disable=not cfg.show_progress, leave=False) as bar:
        async with make_session(cfg) as session:
            before = (await scrape_spec_counters(session, cfg.base_url)
                      if cfg.scrape_metrics else None)
            results, duration = await run_schedule(
                requests, intervals,
                lambda r: send_request(session, cfg.base_url, r, cfg.options),
                cfg.max_concurrency, bar)
            # Only scrape again when the first scrape found counters: no second request to a
            # server that has none.
            after = await scrape_spec_counters(session, cfg.base_url) if before else None
    return RunResult(rate, results, duration, spec_delta(before, after))
