"""A request's LoRA adapter is resolved off the event loop and held from then on (through the
prompt work, before the engine stream holds it), with the registry at its --max_lora_entries
cap: no other request can evict it meanwhile, and every hold is released exactly once, whatever
way the request ends."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeAsyncLLM, FakeTokenizer  # noqa: E402
from test_lora_adapter import write  # noqa: E402

from bladellm.config import LoRAConfig  # noqa: E402
from bladellm.engine.cpu_offload import CpuOffload  # noqa: E402
from bladellm.entrypoints.api_server import build_app  # noqa: E402
from bladellm.entrypoints.openai.config import ServerConfig  # noqa: E402
from bladellm.entrypoints.openai.serving_common import ServingContext  # noqa: E402
from bladellm.lora import registry as registry_module  # noqa: E402
from bladellm.lora.registry import LoRARegistry  # noqa: E402

HF = SimpleNamespace(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, num_hidden_layers=2)
GATE_ID = 99  # a prompt holding this id waits in the tokenizer (the prompt work) for the gate


class GatedTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def decode(self, ids, skip_special_tokens=False):
        if GATE_ID in ids:
            self.entered.set()
            assert self.gate.wait(10)
        return super().decode(ids, skip_special_tokens)


class LoRAEngine(FakeAsyncLLM):
    def __init__(self, reg: LoRARegistry) -> None:
        super().__init__()
        self.lora_registry = reg
        self.model_info.tokenizer = GatedTokenizer()
        self.cpu_offload = CpuOffload(max_workers=2)  # a gated prompt leaves a thread free
        self.loras: list = []

    async def generate(self, prompt, params, request_id, *, lora_request=None, **kwargs):
        self.loras.append(lora_request)
        async for out in super().generate(prompt, params, request_id, **kwargs):
            yield out


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    for n in ("a1", "a2"):
        write(r / n, {})
    return r


def _setup(root):
    reg = LoRARegistry(LoRAConfig(enable_lora=True, lora_root=[str(root)], max_lora_entries=1),
                       HF)
    engine = LoRAEngine(reg)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, ServerConfig())),
                             base_url="http://t")
    return reg, engine, http


async def _wait(event: threading.Event) -> None:
    for _ in range(1000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never reached")


async def test_adapter_is_held_through_the_prompt_work_at_the_cap(root):
    reg, engine, http = _setup(root)
    tok = engine.model_info.tokenizer
    first = asyncio.create_task(http.post("/v1/completions", json={
        "model": "a1", "prompt": [GATE_ID, 100], "max_tokens": 2, "echo": True}))
    await _wait(tok.entered)  # request 1 is rendering its prompt, a1 resolved
    a1 = reg.get("a1")
    assert a1 is not None and reg.holds(a1) == 1
    r = await http.post("/v1/completions", json={"model": "a2", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "lora_registry_full", r.text
    assert reg.get("a1") is a1  # not evicted
    tok.gate.set()
    r = await first
    assert r.status_code == 200 and r.json()["model"] == "a1", r.text
    assert engine.loras[-1].lora_int_id == a1.lora_int_id and reg.holds(a1) == 0
    # Released: a2 may take the only slot now.
    r = await http.post("/v1/completions", json={"model": "a2", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert reg.get("a1") is None


async def test_every_hold_is_released_once_whatever_the_end(root):
    reg, engine, http = _setup(root)
    a1 = reg.resolve("a1")
    reg.acquire(a1)  # a sentinel hold: a doubled release would take it away, a skipped one add
    ok = {"model": "a1", "prompt": "x", "max_tokens": 2}
    for body in (ok, {**ok, "stream": True}, {**ok, "prompt": [100_000]},  # engine 400
                 {**ok, "prompt": [100_000], "stream": True}, {**ok, "max_tokens": 0}):
        r = await http.post("/v1/completions", json=body)
        assert r.status_code in (200, 400), r.text
        assert reg.holds(a1) == 1, body
    for path, body in (("/v1/chat/completions", {"model": "a1", "max_tokens": 2, "messages": [
                            {"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"model": "a1", "input": "hi"}),
                       ("/tokenize", {"model": "a1", "prompt": "hi"}),
                       ("/v1/embeddings", {"model": "a1", "input": "hi"})):
        r = await http.post(path, json=body)
        assert r.status_code in (200, 400), r.text
        assert reg.holds(a1) == 1, path
    engine.step_delay = 0.05
    async with http.stream("POST", "/v1/completions", json={**ok, "stream": True,
                                                            "max_tokens": 50}) as r:
        async for _ in r.aiter_lines():
            break  # the client goes away mid-stream
    for _ in range(100):
        if reg.holds(a1) == 1:
            break
        await asyncio.sleep(0.02)
    assert reg.holds(a1) == 1


async def test_resolution_runs_off_the_loop_and_a_cancelled_one_releases(root, monkeypatch):
    reg = LoRARegistry(LoRAConfig(enable_lora=True, lora_root=[str(root)], max_lora_entries=1),
                       HF)
    engine = LoRAEngine(reg)
    entered, gate, threads = threading.Event(), threading.Event(), []
    real = registry_module.validate_dir

    def slow_validate(*args):
        threads.append(threading.get_ident())
        entered.set()
        assert gate.wait(10)
        return real(*args)

    monkeypatch.setattr(registry_module, "validate_dir", slow_validate)
    ctx = ServingContext.from_engine(engine).for_request()
    task = asyncio.create_task(ctx.check_model("a1"))
    await _wait(entered)  # the loop runs while the adapter directory is read
    task.cancel()  # the client is gone
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    for _ in range(100):
        if reg.get("a1") is not None and reg.holds(reg.get("a1")) == 0:
            break
        await asyncio.sleep(0.02)
    a1 = reg.get("a1")
    assert a1 is not None and reg.holds(a1) == 0
    assert threads and threading.get_ident() not in threads
    ctx.holds.release()  # nothing recorded: nothing more released
    assert reg.holds(a1) == 0
