"""The adapter a request runs with; crosses the process boundary inside ``EngineCoreRequest``."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """``lora_int_id`` is unique per registration (never reused, never 0), so KV blocks cached
    for one adapter are never served to another, even one later loaded under the same name."""

    lora_name: str
    lora_int_id: int
    lora_path: str
