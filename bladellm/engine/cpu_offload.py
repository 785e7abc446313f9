"""CPU work of the API process (tokenization, chat templates, large decodes) off the event loop.

One worker thread: the fast tokenizers release the GIL while they encode, so a 10 MiB prompt no
longer stalls ``/health`` and every other stream; Python-level work (Jinja rendering) still takes
the GIL but the interpreter switches threads every few milliseconds, so the loop keeps
answering. One thread, not a pool, because a transformers tokenizer may reconfigure its Rust
tokenizer (truncation/padding) inside a call, which is not safe from two threads at once.

Grammar validation (``InputProcessor.validate_grammar``: a 100 000-option ``guided_choice``
takes seconds) runs in a second, separate ``CpuOffload`` (``AsyncLLM.grammar_offload``, two
threads), never in the tokenizer's queue: one client's heavy constraint must not hold up the
tokenization of every request behind it. llguidance drops the GIL while it validates, so the
two validations run in parallel and the tokenizer thread and the event loop keep going.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class CpuOffload:
    def __init__(self, name: str = "bladellm-tokenizer", max_workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a worker thread. If the caller is cancelled (client gone)
        while the call is still queued, it never starts; once started it finishes in the thread
        and its result is dropped."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
