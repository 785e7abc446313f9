"""API-process side of results: engine-core outputs → ``RequestOutput``s, stats for loggers.

Per child request (one per sample, see ``input_processor``): incremental detokenization, stop
strings, logprobs (``LogprobRenderer``: the engine's ``Logprobs`` with token text), finish
reasons. Per parent request: fan-in of its children, metrics, prompt logprobs (with the first
output only when ``delta``).

Contract with the caller (``LLMEngine`` / ``AsyncLLM``):

- ``add_request`` before the children are sent to the core; ``process_outputs`` with each batch
  of ``EngineCoreOutput``s; abort every id in ``ProcessedOutputs.reqs_to_abort`` in the core
  (their finish is already decided here, later outputs for them are ignored).
- A parent's ``RequestOutput`` appears in a batch only when one of its children has news. With
  ``delta=True`` it holds, for each child with news, only what is new since the previous one
  (text, token ids, logprobs); otherwise it holds every child with everything so far. Text
  always excludes the held-back tail that could still become a stop string (see detokenizer).
- An error in one child fails the whole request: ``RequestOutput.error`` and ``error_kind``
  are set, that child finishes with "error" and its unfinished siblings with "abort" (and go
  to ``reqs_to_abort``).
- A parent's state is dropped when all its children finished or on ``abort_request``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bladellm.engine.detokenizer import IncrementalDetokenizer
from bladellm.engine.messages import EngineCoreOutput, Logprobs
from bladellm.engine.metrics import FinishedRequestStats, IterationStats
from bladellm.engine.token_bytes import TokenBytes, token_bytes_for
from bladellm.errors import ErrorKind
from bladellm.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from bladellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LogprobRenderer:
    """The engine's ``Logprobs`` as users see them: ``TokenLogprob`` lists with token text and
    bytes. The one place token ids of logprobs become text (sampled and prompt tokens alike)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes: TokenBytes | None = None  # token id -> raw bytes, for chat logprobs

    def render(self, logprobs: Logprobs) -> list[list[TokenLogprob]]:
        """Per position: the chosen token (its rank from the engine), then top-k ranked 1..k."""
        rendered = []
        for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks):
            entry = [self._token_logprob(ids[0], values[0], rank)]
            entry.extend(self._token_logprob(t, v, r)
                         for r, (t, v) in enumerate(zip(ids[1:], values[1:]), start=1))
            rendered.append(entry)
        return rendered

    def _token_logprob(self, token_id: int, value: float, rank: int | None) -> TokenLogprob:
        text = self._token_text(token_id)
        if self._token_bytes is None:  # built on first use: most requests want no logprobs
            self._token_bytes = token_bytes_for(self.tokenizer)
        return TokenLogprob(token_id, value, rank, text, self._token_bytes(token_id, text))

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone (a lone byte of a multi-byte character decodes to U+FFFD)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text


@dataclass
class ProcessedOutputs:
    request_outputs: dict[str, RequestOutput] = field(default_factory=dict)  # by parent id
    reqs_to_abort: list[str] = field(default_factory=list)  # child ids to abort in the core
    iteration: IterationStats = field(default_factory=IterationStats)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class _ChildState:
    def __init__(self, child_id: str, index: int, parent: _ParentState,
                 detokenizer: IncrementalDetokenizer, want_logprobs: bool) -> None:
        self.child_id = child_id
        self.index = index
        self.parent = parent
        self.detokenizer = detokenizer
        self.logprobs: list[list[TokenLogprob]] | None = [] if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_sent_tokens = 0  # delta mode: token ids / logprobs already returned
        self.num_draft_tokens = 0  # speculative decoding: proposed tokens verified
        self.num_accepted_tokens = 0  # and accepted (sent with the core's final output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason


class _ParentState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 delta: bool, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.delta = delta
        self.children: list[_ChildState] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.error_kind: ErrorKind | None = None
        self.aborted = False  # by abort_request (client gone), not by the core
        # SamplingParams.prompt_logprobs: None first (nothing precedes the first token), then
        # one entry per prompt token; from the core with the first token of any child.
        self.prompt_logprobs: list[list[TokenLogprob] | None] | None = None
        self.prompt_logprobs_sent = False  # delta mode: only the first output carries them

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, _ChildState] = {}
        self.logprob_renderer = LogprobRenderer(tokenizer)
        self._aborted: list[_ParentState] = []  # stats reported with the next batch

    # --- request lifecycle -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float,
                    delta: bool) -> None:
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not child_ids:
            raise ValueError("child_ids: need at least one child request")
        taken = [c for c in child_ids if c in self._children]
        if taken:
            raise ValueError(f"child request id {taken[0]!r} is already in use")
        parent = _ParentState(request_id, prompt, list(prompt_token_ids), delta, arrival_time)
        for index, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer.from_tokenizer(self.tokenizer, params,
                                                          parent.prompt_token_ids)
            child = _ChildState(child_id, index, parent, detok, params.logprobs is not None)
            parent.children.append(child)
            self._children[child_id] = child
        self._parents[request_id] = parent

    def abort_request(self, request_id: str) -> list[str]:
        """Forget ``request_id`` (a parent id); returns its unfinished child ids for the core.

        Its ``FinishedRequestStats`` (reason "abort") come with the next ``process_outputs``.
        """
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        to_abort = [c.child_id for c in parent.children if not c.finished]
        for child in parent.children:
            if not child.finished:
                child.finish("abort")
        parent.aborted = True
        self._aborted.append(parent)
        self._remove(parent)
        return to_abort

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def num_unfinished(self) -> int:
        return len(self._parents)

    def get_parent(self, child_id: str) -> str | None:
        child = self._children.get(child_id)
        return child.parent.request_id if child is not None else None

    # --- the per-batch step ------------------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for aborted in self._aborted:
            result.finished.append(self._finished_stats(aborted, now))
        self._aborted = []
        touched: dict[str, list[_ChildState]] = {}  # parent id -> children with news
        timed: set[str] = set()  # parents whose token timing this batch already counted
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None or child.finished:
                continue  # aborted or already stopped by a stop string; late output
            parent = child.parent
            self._record_timing(parent, out, now, timed, result.iteration)
            news = touched.setdefault(parent.request_id, [])
            try:
                if out.error is not None:
                    self._fail(parent, child, (out.error_kind or ErrorKind.FAILED, out.error),
                               news, result.reqs_to_abort)
                    continue
                self._apply(child, out, result.reqs_to_abort)
            except Exception as e:  # a bad token must fail its request, not the engine
                logger.exception("output processing failed for %s", out.request_id)
                if out.finish_reason is None and not child.finished:
                    result.reqs_to_abort.append(child.child_id)  # still running in the core
                self._fail(parent, child, (ErrorKind.FAILED, f"output processing failed: {e}"),
                           news, result.reqs_to_abort)
                continue
            if child not in news:
                news.append(child)
        for parent_id, news in touched.items():
            parent = self._parents[parent_id]
            result.request_outputs[parent_id] = self._make_output(parent, news)
            if parent.finished:
                parent.metrics.finished_time = now
                result.finished.append(self._finished_stats(parent, now))
                self._remove(parent)
        return result

    def _apply(self, child: _ChildState, out: EngineCoreOutput, reqs_to_abort: list[str]) -> None:
        if out.prompt_logprobs is not None and child.parent.prompt_logprobs is None:
            child.parent.prompt_logprobs = [None,
                                            *self.logprob_renderer.render(out.prompt_logprobs)]
        if out.num_draft_tokens:
            child.num_draft_tokens = out.num_draft_tokens
            child.num_accepted_tokens = out.num_accepted_tokens
        detok = child.detokenizer
        num_before = len(detok.token_ids)
        stop_str = detok.update(out.new_token_ids, stop_terminated=(
            out.finish_reason == "stop" and not out.grammar_complete))
        num_kept = len(detok.token_ids) - num_before
        if child.logprobs is not None and out.new_logprobs is not None:
            child.logprobs.extend(self.logprob_renderer.render(out.new_logprobs)[:num_kept])
        if stop_str is not None:
            child.finish("stop", stop_str)
            if out.finish_reason is None:
                reqs_to_abort.append(child.child_id)
        elif out.finish_reason is not None:
            child.finish(out.finish_reason, out.stop_reason)

    def _fail(self, parent: _ParentState, child: _ChildState, error: tuple[ErrorKind, str],
              news: list[_ChildState], reqs_to_abort: list[str]) -> None:
        """Finish ``child`` with an error and its running siblings with "abort"."""
        if parent.error is None:
            parent.error_kind, parent.error = error
        child.finish("error")
        if child not in news:
            news.append(child)
        for sibling in parent.children:
            if sibling is not child and not sibling.finished:
                sibling.finish("abort")
                reqs_to_abort.append(sibling.child_id)
                if sibling not in news:
                    news.append(sibling)

    def _record_timing(self, parent: _ParentState, out: EngineCoreOutput, now: float,
                       timed: set[str], iteration: IterationStats) -> None:
        """TTFT per parent (first token of any child); ITL per parent between output batches."""
        metrics = parent.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = metrics.arrival_time + out.queued_time
        if out.num_cached_tokens and parent.children[0].child_id == out.request_id:
            parent.num_cached_tokens = out.num_cached_tokens
        if not out.new_token_ids:
            return
        iteration.num_generation_tokens += len(out.new_token_ids)
        if parent.request_id in timed:
            return
        timed.add(parent.request_id)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            iteration.time_to_first_tokens.append(now - metrics.arrival_time)
            iteration.num_prompt_tokens += len(parent.prompt_token_ids)
        else:
            latency = now - metrics.last_token_time
            metrics.inter_token_latencies.append(latency)
            iteration.inter_token_latencies.append(latency)
        metrics.last_token_time = now

    # --- building results --------------------------------------------------------------------

    def _make_output(self, parent: _ParentState, news: list[_ChildState]) -> RequestOutput:
        if parent.delta:
            completions = [self._delta_completion(c) for c in sorted(news, key=lambda c: c.index)]
        else:
            completions = [self._cumulative_completion(c) for c in parent.children]
        prompt_logprobs = parent.prompt_logprobs
        if parent.delta and prompt_logprobs is not None:
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions,
            finished=parent.finished, num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics, error=parent.error, error_kind=parent.error_kind,
            prompt_logprobs=prompt_logprobs)

    def _delta_completion(self, child: _ChildState) -> CompletionOutput:
        detok = child.detokenizer
        start = child.num_sent_tokens
        child.num_sent_tokens = len(detok.token_ids)
        return CompletionOutput(
            index=child.index, text=detok.get_delta_text(child.finished),
            token_ids=detok.token_ids[start:],
            logprobs=child.logprobs[start:] if child.logprobs is not None else None,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)

    def _cumulative_completion(self, child: _ChildState) -> CompletionOutput:
        detok = child.detokenizer
        return CompletionOutput(
            index=child.index, text=detok.get_text(child.finished),
            token_ids=list(detok.token_ids),
            logprobs=list(child.logprobs) if child.logprobs is not None else None,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason)

    def _finished_stats(self, parent: _ParentState, now: float) -> FinishedRequestStats:
        metrics = parent.metrics
        if parent.error is not None:
            reason = "error"
        elif parent.aborted:
            reason = "abort"
        else:  # with n > 1 the first sample speaks for the request
            reason = parent.children[0].finish_reason
        queued = (metrics.first_scheduled_time - metrics.arrival_time
                  if metrics.first_scheduled_time is not None else 0.0)
        stats = FinishedRequestStats(
            finish_reason=reason, e2e_latency=max(0.0, now - metrics.arrival_time),
            queued_time=queued, num_prompt_tokens=len(parent.prompt_token_ids),
            num_generation_tokens=sum(len(c.detokenizer.token_ids) for c in parent.children),
            num_cached_tokens=parent.num_cached_tokens,
            num_draft_tokens=sum(c.num_draft_tokens for c in parent.children),
            num_accepted_tokens=sum(c.num_accepted_tokens for c in parent.children))
        if stats.num_draft_tokens:
            logger.info("request %s finished (%s): %d prompt + %d generated tokens; speculative "
                        "decoding accepted %d of %d proposed tokens",
                        parent.request_id, reason, stats.num_prompt_tokens,
                        stats.num_generation_tokens, stats.num_accepted_tokens,
                        stats.num_draft_tokens)
        return stats

    def _remove(self, parent: _ParentState) -> None:
        del self._parents[parent.request_id]
        for child in parent.children:
            self._children.pop(child.child_id, None)
