"""CPU thread settings, chosen deliberately per process.

The engine core gets every core for its GEMMs; the API process keeps torch to one thread so that
tokenization and HTTP never compete with the model for cores.
"""

from __future__ import annotations

import os

import torch


def configure_engine_threads(num_threads: int | None) -> int:
    if num_threads is None:
        num_threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    n = num_threads
    torch.set_num_threads(n)
    return n


def configure_frontend_threads() -> None:
    torch.set_num_threads(1)
