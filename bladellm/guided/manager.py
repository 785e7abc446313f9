"""The engine core's side of structured output.

- ``grammar_for`` gives a request a ``GrammarState`` at once; its grammar compiles in a worker
  thread (or comes from the LRU cache), so the step loop never waits on a compilation. Until it
  is ready the scheduler leaves the request waiting and admits others.
- ``start_bitmask`` fills, in llguidance's thread pool and in the background, the token bitmask
  of every constrained request that samples this step; the model runner collects it
  (``StepBitmask.result``) after the forward pass, so the two overlap. A request verifying k
  speculative tokens gets k + 1 rows: row j is the mask after the grammar consumed the first j
  proposed tokens (llguidance consumes the proposal, fills the masks and rolls back, in the same
  background task; the scheduler already cut the proposal where the grammar rejects it).
- A ``GrammarState`` advances with ``accept_tokens(list)`` (several at once for speculative
  decoding) and can ``rollback(n)``. Preemption by recompute keeps a request's output tokens,
  so its state stays valid and needs no rollback; speculative tokens are consumed only inside a
  mask fill, which rolls them back before ``StepBitmask.result`` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from bladellm.guided.backend import GrammarError, LLGuidanceBackend
from bladellm.guided.bitmask import bitmask_width
from bladellm.guided.cache import CompiledGrammarCache
from bladellm.guided.grammar import cache_key
from bladellm.guided.reasoning_gate import OPTIONAL, THINKING, ReasoningGate
from bladellm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)


class _CompileTiming:
    """When a compilation actually started (``None`` while it is queued or the tokenizer bridge
    is being built); set by the compile thread, read by ``GrammarState``."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started: float | None = None


class GrammarState:
    """One request's grammar: pending until compiled, then an ``LLMatcher`` following its output."""

    def __init__(self, future: Future, timeout: float, clock: Callable[[], float],
                 gate: ReasoningGate | None = None) -> None:
        self._future = future
        # Reasoning models: the grammar starts after the thinking (reasoning_gate.py).
        self.gate = gate
        # The clock runs from the start of this grammar's own compilation (``_CompileTiming``
        # on futures from ``GuidedDecodingManager``), not from submission: time queued behind
        # another client's expensive grammar, or building the tokenizer bridge, is not this
        # request's fault. A bare future (no timing) counts from now.
        self._timing: _CompileTiming | None = getattr(future, "compile_timing", None)
        self._deadline = clock() + timeout
        self._timeout = timeout
        self._clock = clock
        self.matcher: Any = None
        self.compile_error: str | None = None
        self._num_matched = 0  # tokens the matcher consumed (rollback may reach past them)

    def _timed_out(self) -> bool:
        if self._timing is None:
            return self._clock() > self._deadline
        started = self._timing.started
        return started is not None and self._clock() > started + self._timeout

    def is_ready(self) -> bool:
        if self.matcher is not None:
            return True
        if self.compile_error is not None:
            return False
        if not self._future.done():
            if self._timed_out():
                self.compile_error = (f"grammar compilation took longer than "
                                      f"--guided_compile_timeout ({self._timeout:g} s)")
            return False
        exc = self._future.exception()
        if exc is not None:
            self.compile_error = str(exc)
            return False
        self.matcher = self._future.result().deep_copy()
        return True

    @property
    def future(self) -> Future:
        return self._future

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance over ``token_ids``; returns how many were valid (all of them, normally)."""
        gate = self.gate
        if gate is None or gate.is_open:
            return self._consume(token_ids)
        taken = gate.consume(token_ids)
        if taken == len(token_ids):
            return taken
        return taken + self._consume(token_ids[taken:])

    def _consume(self, token_ids: list[int]) -> int:
        n = self.matcher.try_consume_tokens(token_ids)
        self._num_matched += n
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        from_matcher = min(num_tokens, self._num_matched)
        if from_matcher and not self.matcher.rollback(from_matcher):
            raise RuntimeError(f"grammar rollback of {from_matcher} tokens failed: "
                               f"{self.matcher.get_error()}")
        self._num_matched -= from_matcher
        if self.gate is not None and self._num_matched == 0:
            # Every answer token taken back: the gate decides afresh from its own tokens (an
            # optional thinking that a rejected draft token had skipped may still start).
            self.gate.refresh()
        if num_tokens > from_matcher:
            if self.gate is None:
                raise RuntimeError(f"grammar rollback of {num_tokens} tokens, only "
                                   f"{from_matcher} accepted")
            self.gate.rollback(num_tokens - from_matcher)

    def is_terminated(self) -> bool:
        """The grammar reached an end it cannot extend: the output is complete."""
        if self.gate is not None and not self.gate.is_open:
            return False
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        if self.compile_error is not None:
            return self.compile_error
        if self.matcher is not None and self.matcher.is_error():
            return self.matcher.get_error()
        return None


class StepBitmask:
    """This step's bitmask rows, in ``req_ids`` order: one per constrained request that samples,
    k + 1 consecutive rows (its id repeated) for one verifying k speculative tokens, row j the
    mask after its first j proposed tokens. The repeated-id form needs nothing beyond
    ``req_ids`` and ``result()``, so it crosses processes as it is (``ReadyBitmask``)."""

    def __init__(self, req_ids: list[str], future: Future) -> None:
        self.req_ids = req_ids
        self._future = future

    def result(self) -> np.ndarray:
        return self._future.result()

    def wait(self) -> None:
        """Until the fill has finished, without raising its error (``result()`` raises it)."""
        wait([self._future])


class GuidedDecodingManager:
    def __init__(self, backend_factory: Callable[[], LLGuidanceBackend], vocab_size: int,
                 max_num_seqs: int, cache_size: int, compile_timeout: float,
                 clock: Callable[[], float] = time.monotonic, compile_workers: int = 2) -> None:
        self._backend_factory = backend_factory
        self._backend: LLGuidanceBackend | None = None
        self._backend_lock = threading.Lock()
        self.cache = CompiledGrammarCache(cache_size)
        self.compile_timeout = compile_timeout
        self._clock = clock
        # Two compile threads: llguidance drops the GIL while it builds (two validations run in
        # parallel in about the time of one; docs/structured_output.md), so one client's
        # expensive grammar does not queue every other grammar behind it.
        self._compile_pool = ThreadPoolExecutor(compile_workers,
                                                thread_name_prefix="bladellm-grammar")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="bladellm-bitmask")
        self._bitmask = np.full((max_num_seqs, bitmask_width(vocab_size)), -1, np.int32)
        self.num_mask_steps = 0

    @property
    def backend(self) -> LLGuidanceBackend:
        with self._backend_lock:  # built lazily (the costly tokenizer bridge) in the compile thread
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def _compile(self, params: GuidedDecodingParams, timing: _CompileTiming | None = None) -> Any:
        backend = self.backend  # the tokenizer bridge (first use) does not count as compiling
        if timing is not None:
            timing.started = self._clock()
        start = time.perf_counter()
        matcher = backend.compile(params)
        logger.debug("compiled %s grammar in %.1f ms", params.kind,
                     (time.perf_counter() - start) * 1e3)
        return matcher

    def _submit(self, params: GuidedDecodingParams) -> Future:
        timing = _CompileTiming()
        future = self._compile_pool.submit(self._compile, params, timing)
        future.compile_timing = timing  # type: ignore[attr-defined]
        return future

    def compiled(self, params: GuidedDecodingParams) -> Future:
        return self.cache.get(cache_key(params), lambda: self._submit(params))

    def grammar_for(self, params: GuidedDecodingParams) -> GrammarState:
        gate = None
        if params.reasoning_end:
            gate = ReasoningGate(list(params.reasoning_end), params.reasoning_start)
        return GrammarState(self.compiled(params), self.compile_timeout, self._clock, gate)

    @staticmethod
    def wait_any(states: list[GrammarState], timeout: float) -> None:
        """Block until one of ``states`` finishes compiling (or ``timeout`` s pass)."""
        pending = [s.future for s in states if not s.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def warmup(self, schemas: list[GuidedDecodingParams]) -> float:
        """Compile ``schemas`` (and build the tokenizer bridge) now; returns the seconds it took."""
        start = time.perf_counter()
        futures = [self.compiled(p) for p in schemas]
        for params, fut in zip(schemas, futures):
            exc = fut.exception()
            if exc is not None:
                raise ValueError(f"--json_warmup_schemas: {exc}")
        return time.perf_counter() - start

    def start_bitmask(self, entries: list[tuple[str, GrammarState, list[int]]]) -> StepBitmask:
        """Fill the bitmask rows of ``entries`` ``(req_id, state, draft)`` in the background:
        one row for a request that samples one position (``draft`` empty), ``1 + len(draft)``
        for one that verifies the speculative tokens ``draft`` (every one of them but the last
        accepted by the grammar: the scheduler cut the proposal there)."""
        req_ids: list[str] = []
        jobs: list[tuple[Any, int, list[int]]] = []
        fixes: list[tuple[int, int, int]] = []  # (row, copied from row, start token) after fill
        free_rows: list[int] = []  # rows inside the thinking: every token allowed
        for req_id, state, draft in entries:
            k = len(req_ids)
            req_ids.extend([req_id] * (1 + len(draft)))
            gate = state.gate
            if gate is None or gate.is_open:
                jobs.append((state.matcher, k, list(draft)))
                continue
            gate_rows, grammar_from = gate.plan(list(draft))
            if grammar_from is not None:
                jobs.append((state.matcher, k + grammar_from, list(draft[grammar_from:])))
            for j, where in enumerate(gate_rows):
                if where == THINKING:
                    free_rows.append(k + j)
                elif where == OPTIONAL:
                    # The matcher has consumed nothing yet, so its mask here is the one of its
                    # first row (computed now if no grammar row is in this step).
                    if grammar_from is None:
                        jobs.append((state.matcher, k + j, []))
                        fixes.append((k + j, k + j, gate.start_id))  # type: ignore[arg-type]
                    else:
                        fixes.append((k + j, k + grammar_from, gate.start_id))  # type: ignore
        self.num_mask_steps += 1
        return StepBitmask(req_ids, self._mask_pool.submit(self._fill, jobs, len(req_ids),
                                                           free_rows, fixes))

    def _fill(self, jobs: list[tuple[Any, int, list[int]]], num_rows: int,
              free_rows: list[int] = (), fixes: list[tuple[int, int, int]] = ()) -> np.ndarray:
        if num_rows > self._bitmask.shape[0]:  # speculative rows: grow (kept for later steps)
            self._bitmask = np.full((num_rows, self._bitmask.shape[1]), -1, np.int32)
        rows = self._bitmask[:num_rows]
        stride = rows.shape[1] * 4
        executor = self.backend.executor
        for row in free_rows:
            rows[row] = -1
        single = [(m, k) for m, k, draft in jobs if not draft]
        drafts = [job for job in jobs if job[2]]
        if single:
            # One mask per matcher; rows are contiguous in the C-ordered buffer.
            executor.unsafe_compute_mask_ptr(single, rows.ctypes.data, stride, num_rows)
        if drafts:
            for _, k, draft in drafts:
                # Rows past the draft's first rejected (or post-termination) token are not
                # written: allow every token there. They are never used — the target cannot
                # accept a token its mask bans, and tokens after the grammar's end are dropped —
                # but an all-banned row would give NaN probabilities.
                rows[k + 1:k + 1 + len(draft)] = -1
            # llguidance consumes each draft, writes row k + j after its first j tokens (while
            # they are valid), and rolls the matcher back: its state is unchanged afterwards.
            executor.unsafe_compute_mask_ptr_with_draft_token(drafts, rows.ctypes.data, stride,
                                                              num_rows)
        for row, source, start_id in fixes:
            # The first output token may open the thinking instead of starting the answer.
            if row != source:
                rows[row] = rows[source]
            if start_id < rows.shape[1] * 32:
                words = rows[row].view(np.uint32)
                words[start_id // 32] |= np.uint32(1 << (start_id % 32))
        return rows

    def stats(self) -> dict[str, Any]:
        return {**self.cache.stats(), "num_mask_steps": self.num_mask_steps}

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarError", "GrammarState", "GuidedDecodingManager", "StepBitmask"]
