"""The in-memory store behind ``store: true``, ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

Bounded two ways (``--responses_store_max_entries``, ``--responses_store_ttl``): the oldest entry
goes when the store is full, and an entry older than the TTL is gone (dropped when looked up or
when a new entry is put). Lives in the API process, one per app: a restart forgets everything,
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
    stored_at: float = 0.0


@dataclass
class ResponseStore:
    max_entries: int
    ttl: float  # seconds
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        now = self.clock()
        entry.stored_at = now
        self._expire(now)
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None and self.clock() - entry.stored_at > self.ttl:
            del self._entries[response_id]
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._entries.pop(response_id) is not None

    def _expire(self, now: float) -> None:
        # Entries are in insertion order, which is stored_at order: stop at the first live one.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.stored_at <= self.ttl:
                break
            self._entries.popitem(last=False)
