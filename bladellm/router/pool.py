"""The instances behind the router: in-flight accounting, health checks and scraped load.

Each instance is polled every ``--health_check_interval`` seconds: ``GET /health`` decides
whether it takes requests (``--health_check_failures`` failures in a row take it out, one success
puts it back; a refused connection while proxying takes it out at once), and ``GET /metrics``
supplies the load it reports (requests running and waiting), which counts requests that did not
come through this router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bladellm.router.prompt import RequestInfo

logger = logging.getLogger("bladellm.router")

_RUNNING = "bladellm_num_requests_running"
_WAITING = "bladellm_num_requests_waiting"


@dataclass
class Instance:
    url: str
    healthy: bool = True  # optimistic until the first poll says otherwise
    failures: int = 0  # consecutive failed polls
    in_flight: int = 0  # requests in flight through this router
    outstanding_tokens: int = 0  # their estimated remaining tokens
    reported_requests: int = 0  # running + waiting, from the instance's /metrics
    metrics_text: str = ""  # the last /metrics body, for the aggregated /metrics
    mean_request_tokens: Callable[[], int] = field(default=lambda: 0, repr=False)

    @property
    def external_requests(self) -> int:
        """Requests the instance runs that this router did not send (other routers, clients)."""
        return max(0, self.reported_requests - self.in_flight)

    @property
    def load_requests(self) -> int:
        return self.in_flight + self.external_requests

    @property
    def load_tokens(self) -> int:
        return self.outstanding_tokens + self.external_requests * self.mean_request_tokens()


class Ticket:
    """One request's share of an instance's load; ``generated`` lowers it as tokens stream."""

    def __init__(self, instance: Instance, info: RequestInfo) -> None:
        self.instance = instance
        self._remaining = info.cost_tokens
        instance.in_flight += 1
        instance.outstanding_tokens += self._remaining
        self._open = True

    def generated(self, num_tokens: int) -> None:
        drop = min(num_tokens, self._remaining)
        self._remaining -= drop
        self.instance.outstanding_tokens -= drop

    def release(self) -> None:
        if self._open:
            self._open = False
            self.instance.in_flight -= 1
            self.instance.outstanding_tokens -= self._remaining


class InstancePool:
    def __init__(self, urls: list[str], failures_to_remove: int,
                 on_back: Callable[[str], None] | None = None) -> None:
        self.instances = [Instance(url, mean_request_tokens=self._mean_tokens) for url in urls]
        self.failures_to_remove = failures_to_remove
        self._on_back = on_back  # the affinity policy forgets a restarted instance's cache
        self._tokens_total = 0
        self._requests_total = 0

    def _mean_tokens(self) -> int:
        return self._tokens_total // self._requests_total if self._requests_total else 0

    def healthy(self, exclude: set[str] = frozenset()) -> list[Instance]:  # type: ignore[assignment]
        return [i for i in self.instances if i.healthy and i.url not in exclude]

    def admit(self, instance: Instance, info: RequestInfo) -> Ticket:
        self._tokens_total += info.cost_tokens
        self._requests_total += 1
        return Ticket(instance, info)

    # ---- health -------------------------------------------------------------------------

    def mark_down(self, instance: Instance, reason: str) -> None:
        if instance.healthy:
            logger.warning("instance %s taken out: %s", instance.url, reason)
        instance.healthy = False
        instance.failures = max(instance.failures, self.failures_to_remove)

    def _poll_result(self, instance: Instance, ok: bool, reason: str = "") -> None:
        if ok:
            if not instance.healthy:
                logger.info("instance %s is back", instance.url)
                if self._on_back is not None:
                    self._on_back(instance.url)
            instance.healthy, instance.failures = True, 0
            return
        instance.failures += 1
        if instance.failures >= self.failures_to_remove:
            self.mark_down(instance, reason)

    async def poll(self, session: aiohttp.ClientSession, instance: Instance,
                   timeout: float) -> None:
        """One /health (+ /metrics when healthy) poll of one instance."""
        try:
            t = aiohttp.ClientTimeout(total=timeout)
            async with session.get(instance.url + "/health", timeout=t) as resp:
                await resp.read()
                ok, reason = resp.status == 200, f"/health answered {resp.status}"
            if ok:
                async with session.get(instance.url + "/metrics", timeout=t) as resp:
                    if resp.status == 200:
                        self._read_metrics(instance, await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, reason = False, f"/health failed ({type(exc).__name__}: {exc})"
        self._poll_result(instance, ok, reason)

    @staticmethod
    def _read_metrics(instance: Instance, text: str) -> None:
        instance.metrics_text = text
        reported = 0.0
        try:
            for family in text_string_to_metric_families(text):
                if family.name in (_RUNNING, _WAITING):
                    reported += sum(s.value for s in family.samples)
        except ValueError:  # not Prometheus text: keep the router's own view only
            return
        instance.reported_requests = int(reported)

    async def run_health_checks(self, session: aiohttp.ClientSession, interval: float,
                                timeout: float) -> None:
        while True:
            await asyncio.gather(*(self.poll(session, i, timeout) for i in self.instances))
            await asyncio.sleep(interval)
