"""LRU cache of compiled grammars, keyed by the normalised constraint.

Entries are futures, so two requests with the same new schema share one compilation; the value
is a prototype ``LLMatcher`` that each request ``deep_copy()``s (microseconds). Failed
compilations are not kept. ``num_compiles`` / ``hits`` count what happened, for tests and stats.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CompiledGrammarCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"--guided_cache_size: must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.num_compiles = 0

    def get(self, key: str, submit: Callable[[], Future]) -> Future:
        """The future of ``key``'s compiled grammar; ``submit()`` starts a compilation on a miss."""
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None and not _failed(fut):
                self._entries.move_to_end(key)
                self.hits += 1
                return fut
            self.num_compiles += 1
            fut = submit()
            if self.capacity:
                self._entries[key] = fut
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        fut.add_done_callback(lambda f, k=key: self._drop_failed(k, f))
        return fut

    def _drop_failed(self, key: str, fut: Future) -> None:
        if _failed(fut):
            with self._lock:
                if self._entries.get(key) is fut:
                    del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, Any]:
        return {"size": len(self._entries), "capacity": self.capacity, "hits": self.hits,
                "num_compiles": self.num_compiles}


def _failed(fut: Future) -> bool:
    """Done with an error, or cancelled (a shut-down pool): not worth keeping."""
    return fut.done() and (fut.cancelled() or fut.exception() is not None)
