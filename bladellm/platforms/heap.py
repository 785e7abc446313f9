"""The garbage collector's view of a long-running process.

Start-up leaves hundreds of thousands of long-lived objects behind (imported modules, the
model's modules and parameters, the tokenizer, configs). Python's cyclic collector walks every
tracked object of a generation it collects, and the requests of a busy engine allocate enough
per step that older generations are collected every few seconds: each such pass re-walks the
whole start-up heap, on the thread that runs the steps (a profile of offline throughput showed
``gc_collect_main`` and its visitors at ~2.5 % of the process's time). Freezing moves that heap
to the permanent generation, which the collector never walks; what requests allocate is still
collected as before. vLLM freezes its engine's heap after start-up for the same reason.

Only processes that serve until they exit freeze (the engine core, the API process): a frozen
object that later becomes cyclic garbage is never collected, so the offline ``LLM``, which a
program may create and drop many times, leaves the caller's collector alone.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left unreachable, then freeze the rest (call once, when the process
    is ready to serve)."""
    gc.collect()
    gc.freeze()
