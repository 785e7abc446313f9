"""The adapter a request runs with; crosses the process boundary inside ``EngineCoreRequest``."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """``lora_int_id`` is unique per registration (never reused, never 0), so KV blocks cached
    for one adapter are never served to another, even one later loaded under the same name."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        # Users build these by hand (vLLM's ``LoRARequest(name, id, path)``); 0 would mean "no
        # adapter" to the scheduler, so the request would silently run on the base model.
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id: must be an int, got "
                             f"{type(self.lora_int_id).__name__}")
        if self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id: must be > 0 (0 means no adapter), "
                             f"got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: must be a non-empty string, got {self.lora_path!r}")
