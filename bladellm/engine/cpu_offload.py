"""CPU work of the API process (tokenization, chat templates, large decodes) off the event loop.

One worker thread: the fast tokenizers release the GIL while they encode, so a 10 MiB prompt no
longer stalls ``/health`` and every other stream; Python-level work (Jinja rendering) still takes
the GIL but the interpreter switches threads every few milliseconds, so the loop keeps
answering. One thread, not a pool, because a transformers tokenizer may reconfigure its Rust
tokenizer (truncation/padding) inside a call, which is not safe from two threads at once.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class CpuOffload:
    def __init__(self, name: str = "bladellm-tokenizer") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the worker thread. If the caller is cancelled (client
        gone) the call still finishes in the thread; its result is dropped."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
