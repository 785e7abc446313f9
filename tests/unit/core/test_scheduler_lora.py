"""LoRA admission: adapters not yet in host memory wait without blocking the queue; running
requests use at most ``max_loras`` distinct adapters; adapters never share prompt-cache blocks."""

from __future__ import annotations

from bladellm.lora.request import LoRARequest
from bladellm.request import Request
from bladellm.sampling_params import SamplingParams
from sched_utils import FakeRunner, make_scheduler, step


def lora_request(req_id: str, lora_id: int, prompt_len: int = 8, max_tokens: int = 4,
                 start: int = 10) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/x/a{lora_id}") if lora_id else None
    return Request(req_id, [start + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens),
                   max_model_len=64, arrival_time=0.0, lora_request=lora)


def lora_scheduler(max_loras: int = 1, **kwargs):
    sched = make_scheduler(**kwargs)
    sched.max_loras = max_loras
    return sched


def test_unready_adapter_waits_without_blocking_others():
    sched = lora_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(lora_request("lora", 7))
    sched.add_request(lora_request("base", 0))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["base"]
    assert sched.wanted_loras() == {7: LoRARequest("a7", 7, "/x/a7")}
    sched.lora_ready = {7}
    so, _ = step(sched, runner)
    assert "lora" in so.num_scheduled_tokens
    assert so.scheduled_new_reqs[0].lora_id == 7


def test_running_requests_use_at_most_max_loras_adapters():
    sched = lora_scheduler(max_loras=2)
    sched.lora_ready = {1, 2, 3}
    runner = FakeRunner(sched)
    for i, lora_id in enumerate([1, 2, 3, 1, 0]):
        sched.add_request(lora_request(f"r{i}", lora_id, start=10 + 20 * i))
    so, _ = step(sched, runner)
    # r2 (adapter 3) waits; r3 (adapter 1, already running) and the base request do not.
    assert sorted(so.num_scheduled_tokens) == ["r0", "r1", "r3", "r4"]
    while "r2" not in so.num_scheduled_tokens:
        so, _ = step(sched, runner)
        running = {r.lora_id for r in sched.running if r.lora_id}
        assert len(running) <= 2
    assert {r.request_id for r in sched.running} & {"r0", "r1", "r3"} != {"r0", "r1", "r3"}


def test_failed_adapter_fails_its_requests():
    sched = lora_scheduler()
    sched.add_request(lora_request("a", 5))
    sched.add_request(lora_request("b", 5))
    sched.add_request(lora_request("c", 0))
    outs = sched.fail_lora(5, "cannot load LoRA adapter: bad")
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.error and o.finish_reason == "error" for o in outs)
    assert set(sched.requests) == {"c"}
    sched.check_invariants()


def test_prompt_cache_is_per_adapter():
    sched = lora_scheduler(max_loras=2)
    sched.lora_ready = {1, 2}
    runner = FakeRunner(sched)
    sched.add_request(lora_request("first", 1, prompt_len=16))
    for _ in range(6):
        step(sched, runner)
    assert not sched.requests
    for req_id, lora_id in [("other", 2), ("base", 0), ("same", 1)]:
        sched.add_request(lora_request(req_id, lora_id, prompt_len=16))
        so, _ = step(sched, runner)
        hit = so.scheduled_new_reqs[0].num_computed_tokens
        assert hit == (12 if req_id == "same" else 0), req_id
