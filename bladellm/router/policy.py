"""Routing policies: pick one of the healthy instances for a request. No I/O here.

An instance's load is seen through two numbers (``pool.Instance``): ``load_requests`` (requests
in flight through this router, plus any others the instance reports running or waiting) and
``load_tokens`` (the tokens those requests still have to process or generate, estimated).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from bladellm.router.prompt import RequestInfo


class Candidate(Protocol):
    url: str

    @property
    def load_requests(self) -> int: ...

    @property
    def load_tokens(self) -> int: ...


class Policy(Protocol):
    name: str

    def choose(self, info: RequestInfo, candidates: Sequence[Candidate]) -> Candidate:
        """``candidates`` is non-empty; the returned one gets the request."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, info: RequestInfo, candidates: Sequence[Candidate]) -> Candidate:
        return candidates[next(self._counter) % len(candidates)]


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """Fewest outstanding tokens; ties go to fewer requests, then to the first listed."""
    return min(candidates, key=lambda c: (c.load_tokens, c.load_requests))


class LeastOutstandingTokens:
    name = "least_tokens"

    def choose(self, info: RequestInfo, candidates: Sequence[Candidate]) -> Candidate:
        return least_loaded(candidates)


class _BlockLRU:
    """Block hashes recently routed to one instance, oldest first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes this instance has seen (hashes chain, so a hit at ``i``
        implies the whole prefix up to ``i`` was seen)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


class PrefixAffinity:
    """Send a request where its longest prompt prefix was sent before (an approximate radix
    tree: per instance, the chained hashes of the prompt blocks routed to it, in LRU order).

    **Bounded loads** (``balance_factor`` c, consistent hashing with bounded loads, Mirrokni,
    Thorup and Zadimoghaddam 2018): an instance may take the request only while it then has at
    most ``ceil(c * (m + 1) / n)`` requests in flight, ``m`` being the requests in flight on all
    ``n`` candidates. Among those that may, the longest match wins, so a known prefix sticks to
    its instance until that instance is ``c`` times busier than the average, then goes to the
    instance with the next-longest match that has room (usually the least loaded); a new prefix
    (no match anywhere) goes to the least loaded. The ceiling is never below the least loaded
    instance's count + 1, so some instance always has room. ``balance_factor=None`` turns the
    bound off.

    Among equal matches the least loaded in outstanding tokens wins, unless it has more than
    ``overload_margin`` requests in flight beyond the least busy instance overall: then the least
    busy instance takes it (and learns the prefix). An instance that comes back from being
    unhealthy starts with an empty memory, as its restarted engine starts with an empty cache."""

    name = "prefix_affinity"

    def __init__(self, overload_margin: int, cache_blocks: int,
                 balance_factor: float | None = None) -> None:
        if balance_factor is not None and balance_factor < 1:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        self.overload_margin = overload_margin
        self.cache_blocks = cache_blocks
        self.balance_factor = balance_factor
        self._seen: dict[str, _BlockLRU] = {}
        self._last_chosen: dict[str, int] = {}
        self._counter = itertools.count()

    def _lru(self, url: str) -> _BlockLRU:
        if url not in self._seen:
            self._seen[url] = _BlockLRU(self.cache_blocks)
        return self._seen[url]

    def forget(self, url: str) -> None:
        self._lru(url).clear()

    def capacity(self, candidates: Sequence[Candidate]) -> int | None:
        """Most requests in flight an instance may have after taking one more (None: no bound)."""
        if self.balance_factor is None:
            return None
        total = sum(c.load_requests for c in candidates)
        # The epsilon keeps float rounding (1.1 * 10 = 11.000000000000002) from adding one.
        return math.ceil(self.balance_factor * (total + 1) / len(candidates) - 1e-9)

    def choose(self, info: RequestInfo, candidates: Sequence[Candidate]) -> Candidate:
        cap = self.capacity(candidates)
        room = candidates if cap is None else [c for c in candidates if c.load_requests < cap]
        room = room or candidates  # cannot be empty for c >= 1 (docstring); a guard only
        matches = [self._lru(c.url).matched(info.block_hashes) for c in room]
        best = max(matches)
        tied = [c for c, m in zip(room, matches) if m == best]
        # Equal loads (an idle system) go to the instance chosen least recently, so that new
        # prefixes spread over the instances instead of all going to the first one.
        preferred = min(tied, key=lambda c: (c.load_tokens, c.load_requests,
                                             self._last_chosen.get(c.url, -1)))
        least_busy = min(c.load_requests for c in candidates)
        chosen = preferred
        if preferred.load_requests > least_busy + self.overload_margin:
            chosen = min(candidates, key=lambda c: (c.load_requests, c.load_tokens))
        self._lru(chosen.url).touch(info.block_hashes)
        self._last_chosen[chosen.url] = next(self._counter)
        return chosen


def make_policy(name: str, overload_margin: int = 4, cache_blocks: int = 65536,
                balance_factor: float | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_tokens":
        return LeastOutstandingTokens()
    if name == "prefix_affinity":
        return PrefixAffinity(overload_margin, cache_blocks, balance_factor)
    raise ValueError(f"--policy: unknown policy {name!r}")
