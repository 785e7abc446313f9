"""Messages across the API-process ↔ engine-core boundary (msgspec structs, msgpack on ZMQ).

The per-request output and the stats are defined by the scheduler (``core/outputs.py``) and sent
as they are; this module adds the request message and the per-step envelope.
"""

from __future__ import annotations

import msgspec

from bladellm.core.outputs import EngineCoreOutput, Logprobs, SchedulerStats
from bladellm.lora.request import LoRARequest
from bladellm.multimodal.inputs import MultiModalItem
from bladellm.sampling_params import SamplingParams

__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "Logprobs",
           "SchedulerStats"]


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora_request: LoRARequest | None = None
    priority: int = 0  # --scheduling_policy priority: lower runs first
    mm_items: list[MultiModalItem] = []  # images, in prompt order (bladellm.multimodal)


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Reply to a UTILITY call: (call_id, result) encoded as msgpack-able data.
    utility_result: tuple[int, object] | None = None
    engine_dead: str | None = None  # set once, when the core dies, with the reason
