"""The in-memory store behind ``store: true``, ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

Bounded three ways (``--responses_store_max_entries``, ``--responses_store_max_bytes``,
``--responses_store_ttl``): the oldest entries go when the store holds too many or too many bytes
(an entry larger than the whole byte bound is not kept), and an entry older than the TTL is gone
(dropped when looked up or when a new entry is put). An entry's size is the JSON size of what it
holds, its earlier turns included, though a ``previous_response_id`` chain shares those: the
count errs on the side of keeping less. Lives in the API process, one per app: a restart forgets everything,
and behind ``blade_llm_router`` a follow-up request must reach the same instance.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bladellm.entrypoints.openai.protocol_responses import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    # The conversation through this response's output, as input items (earlier turns, this
    # request's input, then its output); the request's ``instructions`` are not part of it, as
    # OpenAI does not carry them over to a follow-up.
    items: list[dict[str, Any]]
    num_input: int  # items[:num_input] were the request's input (earlier turns included)
    size: int = 0  # bytes, as counted against ResponseStore.max_bytes
    stored_at: float = 0.0


@dataclass
class ResponseStore:
    max_entries: int
    ttl: float  # seconds
    max_bytes: int  # the sum of the entries' sizes
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> None:
        if not self.enabled or entry.size > self.max_bytes:
            return
        now = self.clock()
        entry.stored_at = now
        self._expire(now)
        self._pop(entry.response.id)
        self._entries[entry.response.id] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._pop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None and self.clock() - entry.stored_at > self.ttl:
            self._pop(response_id)
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._pop(response_id) is not None

    def _pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _expire(self, now: float) -> None:
        # Entries are in insertion order, which is stored_at order: stop at the first live one.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.stored_at <= self.ttl:
                break
            self._pop(oldest.response.id)
