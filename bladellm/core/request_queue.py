"""The scheduler's waiting queue under ``--scheduling_policy fcfs`` or ``priority``.

Both queues answer the same few calls (``add``, ``prepend``, ``peek``, ``pop``, ``remove``,
``len``, iteration); the scheduler does not know which one it holds, except that under
``priority`` it also keeps its running list in ``schedule_key`` order and lets a waiting request
preempt a running one with a larger key (core/scheduler.py).

Priority order with aging. A request of priority ``p`` that arrived at ``t`` has, at time
``now``, the effective priority ``p - (now - t) / I`` (``I``: ``--priority_aging_interval``):
every ``I`` seconds of waiting improve it by one level. Comparing two requests' effective
priorities at any common ``now`` gives the same answer as comparing ``p * I + t``, so the order
never changes while they wait and a heap keyed once, at arrival, is exact. The starvation bound
follows: a request ``(p, t)`` is never passed by a request of priority ``q`` that arrived after
``t + (p - q) * I``. Ties (equal keys, e.g. the ``n > 1`` children of one request) keep arrival
order through a sequence number.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from bladellm.request import Request

ScheduleKey = tuple[float, int]


def schedule_key(priority: int, arrival_time: float, seq: int,
                 aging_interval: float) -> ScheduleKey:
    """Smaller runs first: effective priority in seconds of arrival time, then arrival order."""
    return (priority * aging_interval + arrival_time, seq)


class RequestQueue(ABC):
    """Waiting requests in the order the scheduler admits them."""

    @abstractmethod
    def add(self, req: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def prepend(self, reqs: Iterable[Request]) -> None:
        """Requests back from the scheduler (preempted, or held back this step): under fcfs
        ahead of every other, in the given order; under priority, at their key's place."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to admit (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    @abstractmethod
    def remove(self, req_ids: set[str]) -> None:
        """Drop these requests (finished while waiting: aborted, timed out)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no guaranteed order under priority."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(deque, RequestQueue):
    """First come, first served; preempted requests go back to the front."""

    def add(self, req: Request) -> None:
        self.append(req)

    def prepend(self, reqs: Iterable[Request]) -> None:
        self.extendleft(reversed(list(reqs)))

    def peek(self) -> Request:
        return self[0]

    def pop(self) -> Request:  # type: ignore[override]
        return self.popleft()

    def remove(self, req_ids: set[str]) -> None:  # type: ignore[override]
        kept = [r for r in self if r.request_id not in req_ids]
        self.clear()
        self.extend(kept)


class PriorityQueue(RequestQueue):
    """A heap on ``Request.schedule_key`` (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[ScheduleKey, Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.schedule_key, req))

    def prepend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.add(req)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req_ids: set[str]) -> None:
        self._heap = [item for item in self._heap if item[1].request_id not in req_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in self._heap)


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"--scheduling_policy: unknown policy {policy!r}")
