"""A deterministic stand-in for ``AsyncLLM`` with the same interface, for server unit tests.

One token per character (id = code point); choice ``j`` generates the letters "abcdefghij"
starting at offset ``j``. Failure modes are switched on per test through attributes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from bladellm.engine.embedding import EmbeddingOutput, check_prompt
from bladellm.engine.input_processor import InputProcessor
from bladellm.errors import EngineDeadError, ServerShuttingDownError
from bladellm.engine.messages import SchedulerStats
from bladellm.outputs import CompletionOutput, RequestOutput, TokenLogprob
from bladellm.sampling_params import SamplingParams

LETTERS = "abcdefghij"


class FakeTokenizer:
    eos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) if ord(c) < 256 else ord("?") for c in text]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i >= 2)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
        return type("Enc", (), {"input_ids": self.encode(text, add_special_tokens)})()

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeModelInfo:
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    max_model_len: int = 128
    served_model_name: str = "fake-model"
    eos_token_ids: list[int] = field(default_factory=lambda: [1])
    vocab_size: int = 300
    has_chat_template: bool = True
    sampling_defaults: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.7,
                                                                        "top_k": 20})


class FakeInputProcessor(InputProcessor):
    """The real checks and message handling over the fake tokenizer; remembers the template
    arguments of the last chat."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        self.last_kwargs = kwargs
        return super().apply_chat_template(messages, add_generation_prompt, **kwargs)


class FakeAsyncLLM:
    def __init__(self, step_delay: float = 0.0) -> None:
        self.model_info = FakeModelInfo()
        self.input_processor = FakeInputProcessor(self.model_info)
        self.step_delay = step_delay
        self.raise_on_generate: Exception | None = None  # raised before the first output
        self.fail_after_tokens: int | None = None  # per-request error after that many tokens
        self.eos_after_tokens: int | None = None  # finish "stop" unless ignore_eos
        self.calls: list[tuple[Any, SamplingParams, str]] = []
        self.priorities: list[int] = []  # the scheduling priority of each generate call
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.dead_reason: str | None = None
        self.started = asyncio.Event()  # set when a request produced its first token
        self.fail_reason: str | None = None  # set by fail_all (server shutdown)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)

    def get_scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.active), num_used_blocks=2 * len(self.active),
                              num_total_blocks=100, kv_cache_usage=len(self.active) / 50)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def remove_lora(self, name: str) -> None:  # as AsyncLLM's, with no engine copy
        registry = getattr(self, "lora_registry", None)  # set by the LoRA tests
        if registry is None:
            raise ValueError("LoRA is not enabled (--enable_lora)")
        registry.remove(name)

    @property
    def num_in_flight(self) -> int:
        return len(self.active)

    def fail_all(self, reason: str) -> int:
        self.fail_reason = reason
        return len(self.active)

    def shutdown(self) -> None:
        self.dead_reason = "shut down"

    async def embed(self, prompts: list[str | list[int]], dimensions: int | None = None,
                    truncate_prompt_tokens: int | None = None) -> list[EmbeddingOutput]:
        """Like ``AsyncLLM.embed``: tokenize (an empty string is refused as the engine's
        ``prompt``), check each input, then a vector of (length, first id)."""
        await self.check_health()
        info = self.model_info
        ids = []
        for p in prompts:
            if isinstance(p, str) and not p:
                raise ValueError("prompt: must not be empty")
            ids.append(info.tokenizer.encode(p) if isinstance(p, str) else list(p))
        for i, one in enumerate(ids):
            check_prompt(one, info.max_model_len, info.vocab_size, i)
        return [EmbeddingOutput([float(len(one)), float(one[0])], one) for one in ids]

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       *, delta: bool = True, priority: int = 0, lora_request: Any = None):
        self.lora_requests = [*getattr(self, "lora_requests", []), lora_request]
        self.calls.append((prompt, params, request_id))
        self.priorities.append(priority)
        await self.check_health()
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        # AsyncLLM's admission: tokenize and check (bad ids, too long: before any output).
        ids = self.input_processor.process(request_id, prompt, params, 0.0,
                                           validate_grammar=False,
                                           priority=priority)[0].prompt_token_ids
        max_tokens = params.max_tokens or self.model_info.max_model_len - len(ids)
        n = params.n
        finished = [False] * n
        self.active.add(request_id)
        try:
            for step in range(max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                if self.fail_reason is not None:
                    raise ServerShuttingDownError(self.fail_reason)
                outputs = []
                for j in range(n):
                    if finished[j]:
                        continue
                    if self.fail_after_tokens is not None and step == self.fail_after_tokens:
                        yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                                            ids, [CompletionOutput(j, "", [], None, "error")],
                                            finished=True, error="boom in the engine")
                        return
                    ch = LETTERS[(step + j) % len(LETTERS)]
                    reason = None
                    if step == max_tokens - 1:
                        reason = "length"
                    elif (not params.ignore_eos and self.eos_after_tokens is not None
                          and step == self.eos_after_tokens - 1):
                        reason = "stop"
                    lp = None
                    if params.logprobs is not None:
                        # Letter k has logprob -1 - k and rank k + 1 at every step; the
                        # sampled one is in the top-k or not.
                        top = [TokenLogprob(ord(LETTERS[k]), -1.0 - k, k + 1, LETTERS[k])
                               for k in range(params.logprobs)]
                        rank = LETTERS.index(ch)
                        lp = [[TokenLogprob(ord(ch), -1.0 - rank, rank + 1, ch)] + top]
                    finished[j] = reason is not None
                    outputs.append(CompletionOutput(j, ch, [ord(ch)], lp, reason))
                self.started.set()
                yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                                    outputs, finished=all(finished), num_cached_tokens=1)
                if all(finished):
                    self.completed.append(request_id)
                    return
        finally:
            self.active.discard(request_id)
            if not all(finished) and request_id not in self.completed:
                self.aborted.append(request_id)
