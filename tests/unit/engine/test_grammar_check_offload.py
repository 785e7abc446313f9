"""Grammar validation in the API process must not sit in the tokenizer's serial queue: a slow
(heavy but valid) constraint must not hold up unconstrained requests behind it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from bladellm.engine.async_llm import AsyncLLM
from bladellm.engine.cpu_offload import CpuOffload
from bladellm.engine.input_processor import InputProcessor
from bladellm.sampling_params import GuidedDecodingParams, SamplingParams


class _Tokenizer:
    eos_token_id = 1

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 200 + 2 for c in text]


@dataclass
class _Info:
    tokenizer: _Tokenizer = field(default_factory=_Tokenizer)
    max_model_len: int = 128
    vocab_size: int = 256
    eos_token_ids: tuple = (1,)


class _SlowValidator:
    """Blocks every validation until ``release`` is set; counts started validations."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0
        self._lock = threading.Lock()

    def validate(self, params) -> None:
        with self._lock:
            self.started += 1
        assert self.release.wait(10)


class _Client:
    is_dead = False
    proc = SimpleNamespace(is_alive=lambda: True)

    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_requests(self, reqs) -> None:
        self.added.extend(r.request_id for r in reqs)

    async def abort_requests(self, ids) -> None:
        pass


def _engine(validator: _SlowValidator) -> AsyncLLM:
    llm = AsyncLLM.__new__(AsyncLLM)
    llm.config = SimpleNamespace(scheduler=SimpleNamespace(max_queue_size=None))
    llm.client = _Client()
    llm.input_processor = InputProcessor(_Info())
    llm.input_processor._grammar_validator = validator
    llm.output_processor = SimpleNamespace(add_request=lambda *a, **k: None,
                                           abort_request=lambda rid: [])
    llm.cpu_offload = CpuOffload()
    llm.grammar_offload = CpuOffload("bladellm-grammar-check", max_workers=2)
    llm._queues, llm._not_started, llm._background = {}, set(), set()
    llm._failed_all = None
    llm._ensure_output_task = lambda: None
    return llm


def _run(main) -> None:
    """Run ``main(llm, validator)`` on a fresh engine; always unblock and stop its threads."""
    validator = _SlowValidator()
    llm = _engine(validator)
    try:
        asyncio.run(main(llm, validator))
    finally:
        validator.release.set()
        llm.cpu_offload.shutdown()
        llm.grammar_offload.shutdown()


def _guided() -> SamplingParams:
    return SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(choice=["a", "b"]))


async def _first(llm: AsyncLLM, rid: str, params: SamplingParams) -> None:
    agen = llm.generate("hello", params, rid)
    try:
        await agen.__anext__()
    finally:
        await agen.aclose()


def test_unconstrained_request_is_not_held_up_by_a_slow_grammar_check():
    async def main(llm: AsyncLLM, validator: _SlowValidator) -> None:
        guided = _guided()
        heavy = [asyncio.create_task(_first(llm, f"g{i}", guided)) for i in range(4)]
        await asyncio.sleep(0.1)
        plain = asyncio.create_task(_first(llm, "plain", SamplingParams(max_tokens=1)))
        start = time.monotonic()
        while "plain" not in llm.client.added and time.monotonic() - start < 2:
            await asyncio.sleep(0.01)
        reached = "plain" in llm.client.added
        # The heavy ones are still being validated: none reached the engine yet.
        assert not any(r.startswith("g") for r in llm.client.added)
        validator.release.set()
        for t in heavy + [plain]:
            t.cancel()
        await asyncio.gather(*heavy, plain, return_exceptions=True)
        assert reached, "an unconstrained request waited behind grammar validation"

    _run(main)


def test_grammar_check_of_a_client_gone_while_queued_never_starts():
    async def main(llm: AsyncLLM, validator: _SlowValidator) -> None:
        guided = _guided()
        busy = [asyncio.create_task(_first(llm, f"g{i}", guided)) for i in range(2)]
        await asyncio.sleep(0.1)
        assert validator.started == 2  # both check threads busy
        gone = asyncio.create_task(_first(llm, "gone", guided))
        await asyncio.sleep(0.1)
        gone.cancel()  # the client left while its check was queued
        await asyncio.gather(gone, return_exceptions=True)
        validator.release.set()
        await asyncio.sleep(0.2)
        assert validator.started == 2
        assert "gone" not in llm._not_started
        for t in busy:
            t.cancel()
        await asyncio.gather(*busy, return_exceptions=True)

    _run(main)
