"""--max_num_encoder_tokens_per_step: chunks stop before images that would overspend a step's
encoder budget; images already started cost nothing; a lone oversized image still runs."""

from __future__ import annotations

import numpy as np
import pytest

from bladellm.config import CacheConfig, SchedulerConfig
from bladellm.core.interface import ModelRunnerOutput
from bladellm.core.scheduler import Scheduler
from bladellm.multimodal.inputs import MultiModalItem, TensorData
from bladellm.request import Request
from bladellm.sampling_params import SamplingParams


def image(offset: int, length: int, tag: str) -> MultiModalItem:
    return MultiModalItem(modality="image", hash=tag, offset=offset, length=length,
                          tensors={"pixel_values": TensorData.of(np.zeros(1, np.float32))})


def request(req_id: str, n: int, items: list[MultiModalItem]) -> Request:
    return Request(req_id, [10 + i % 50 for i in range(n)], SamplingParams(max_tokens=2),
                   mm_items=items)


def scheduler(encoder_tokens: int | None, batched: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=batched,
                          max_num_encoder_tokens_per_step=encoder_tokens)
    return Scheduler(cfg, CacheConfig(block_size=4, disable_prompt_cache=True), 64, 128)


def step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(
        req_ids=list(out.num_scheduled_tokens), sampled_token_ids=[
            [5] if s.requests[r].num_computed_tokens + n >= s.requests[r].num_tokens else []
            for r, n in out.num_scheduled_tokens.items()]))
    return dict(out.num_scheduled_tokens)


def test_chunk_stops_before_an_image_over_budget():
    s = scheduler(encoder_tokens=16)
    s.add_request(request("a", 40, [image(2, 16, "x"), image(20, 16, "y")]))
    assert step(s) == {"a": 20}  # the first image fits; the chunk ends before the second
    assert step(s) == {"a": 20}  # the second image, in the next step


def test_budget_is_shared_by_the_step():
    s = scheduler(encoder_tokens=16, batched=40)
    s.add_request(request("a", 30, [image(0, 16, "x")]))
    s.add_request(request("b", 30, [image(0, 16, "y")]))
    assert step(s) == {"a": 30}  # b's image would overspend the step: b waits its turn
    assert step(s) == {"a": 1, "b": 30}


def test_an_image_started_in_an_earlier_step_is_free():
    s = scheduler(encoder_tokens=16, batched=16)
    s.add_request(request("a", 30, [image(4, 16, "x"), image(24, 4, "y")]))
    assert step(s) == {"a": 16}  # x starts here
    # [16, 30): x's tail costs nothing, so y (4 tokens) fits beside it.
    assert step(s) == {"a": 14}


def test_oversized_image_runs_alone():
    s = scheduler(encoder_tokens=8)
    s.add_request(request("a", 30, [image(4, 16, "x")]))
    assert step(s) == {"a": 30}


def test_no_limit_by_default():
    s = scheduler(encoder_tokens=None)
    s.add_request(request("a", 40, [image(0, 16, "x"), image(20, 16, "y")]))
    assert step(s) == {"a": 40}


def test_flag_is_validated():
    with pytest.raises(ValueError, match="--max_num_encoder_tokens_per_step"):
        SchedulerConfig(max_num_encoder_tokens_per_step=0)
