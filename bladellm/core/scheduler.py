"""Token-budget continuous batching.

One accounting rule: each request has ``num_tokens`` (prompt + output so far) and
``num_computed_tokens`` (KV in cache); every step grants tokens so that the second catches up
with the first. Chunked prefill, prompt-cache hits, decode and recompute after preemption are
all this rule; there is no prefill or decode code path.

``schedule()``:
1. Waiting requests that never started and waited longer than ``max_queue_time`` fail.
2. Running requests, oldest first, get ``min(num_tokens - num_computed_tokens, budget)`` tokens.
   When the pool cannot hold them, the newest running request is preempted (blocks freed,
   recomputed later from the front of the queue) — possibly the one being scheduled.
3. Unless step 2 preempted, waiting requests are admitted in queue order with their longest
   cached prefix, chunked to the remaining budget, while budget, ``max_num_seqs`` and blocks
   allow. A request whose next block is being computed by a running request ("pending") waits
   a step so it gets a cache hit instead of recomputing it (``n > 1`` siblings, shared system
   prompts).

``--scheduling_policy`` (core/request_queue.py): under fcfs the queue is arrival order and
"newest" is admission order. Under priority both follow ``Request.schedule_key`` (priority, aged
by waiting time, then arrival): ``running`` is kept sorted by it, so step 2 serves the most
urgent first and preempts the least urgent, and in step 3 a waiting request that lacks blocks
or a sequence slot preempts running requests with a larger key (taking back their grant if
they were scheduled this step).

``--async_scheduling``: the engine schedules step n + 1 before step n's output is applied.
Each scheduled request keeps a FIFO of its unapplied grants (``_in_flight``: tokens, whether the
step samples); grants start after them (``_scheduled_end``), and a step that samples counts one
placeholder token (``_num_placeholders``) whose id the runner takes from that step's sampled ids.
``update_from_output`` applies grants in order, so ``num_computed_tokens`` and ``num_tokens``
keep their meaning (applied, known). A request goes one step ahead at most, and not when its
in-flight token is known to be its last (``max_tokens``, the context length) or its next step
needs that token on the host (a grammar's mask, penalties): ``_may_overlap``. A request that
turns out finished (EOS, a stop token) when its ids arrive is freed then; the output of a step
already scheduled for it is dropped. Without the flag a request in flight waits for its output.

Progress guarantee: the pool holds at least one ``max_model_len`` request (checked at
construction), and the first running request (oldest, or most urgent) only ever preempts ones
after it, so it always advances.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence

from bladellm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from bladellm.core import spec_decode, stop_rules
from bladellm.core.block_pool import _require
from bladellm.core.encoder_budget import EncoderBudget
from bladellm.core.interface import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput)
from bladellm.core.kv_cache_manager import KVCacheManager, cdiv
from bladellm.core.outputs import QUEUE_TIMEOUT_ERROR, EngineCoreOutput, Logprobs, SchedulerStats
from bladellm.core.request_queue import make_queue, schedule_key
from bladellm.errors import ErrorKind
from bladellm.request import Request, RequestStatus


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, max_model_len: int, *,
                 clock: Callable[[], float] = time.time,
                 speculative: SpeculativeConfig | None = None,
                 spec_costs: spec_decode.SpecCosts | None = None,
                 max_loras: int | None = None,
                 eos_token_ids: Iterable[int] = (),
                 sliding_window: int | None = None,
                 kv_group_windows: Sequence[int | None] | None = None) -> None:
        """``kv_group_windows``: the window (None: global) of each KV cache group
        (core/kv_groups.py); by default one group with ``sliding_window`` (the model's, when
        every layer has one; blocks before it are freed)."""
        self.config = scheduler_config
        # The model's end-of-sequence ids (``EngineCore.set_eos_token_ids``, once at start-up).
        self.eos_token_ids = frozenset(eos_token_ids)
        # sps: the draft writes its KV for the proposals at the end of a step, so a request that
        # samples gets blocks for that many positions past its scheduled tokens.
        self.num_lookahead_slots = (speculative.gamma if speculative is not None
                                    and speculative.decode_algo == "sps" else 0)
        # The cost rule (core/spec_decode.py): which proposals run, which requests the draft
        # proposes for.
        self.spec_policy = spec_decode.SpecPolicy(speculative, spec_costs)
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.clock = clock
        windows = (list(kv_group_windows) if kv_group_windows is not None
                   else [sliding_window])
        need = sum(self._blocks_per_request(window, max_model_len,
                                            scheduler_config.max_num_batched_tokens)
                   for window in windows)
        if num_blocks - 1 < need:
            raise ValueError(
                f"--num_kv_blocks / --kv_cache_memory: the KV cache holds {num_blocks} blocks "
                f"(one reserved) of {self.block_size} tokens, fewer than one request of "
                f"--max_model_len {max_model_len} needs ({need} blocks"
                f"{f' over {len(windows)} KV cache groups' if len(windows) > 1 else ''}); "
                f"give the cache more memory or lower --max_model_len")
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prompt_cache,
                                               group_windows=windows)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = make_queue(scheduler_config.scheduling_policy)
        self.priority = scheduler_config.priority_scheduling
        self._arrival_seq = itertools.count()
        # fcfs: admission order; priority: schedule_key order. The last is preempted first.
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self._pending_outputs: list[EngineCoreOutput] = []  # sent by the next update_from_output
        self._runner_num_tokens: dict[str, int] = {}  # tokens the runner knows, per request
        self._queued_time: dict[str, float] = {}  # until the first output carries it
        # Grants whose output is not applied yet, oldest first: (tokens, whether it samples).
        self._in_flight: dict[str, deque[tuple[int, bool]]] = {}
        # Preempted with steps still in flight (their outputs are ignored): how many. Such a
        # request is resumed only once they are back, or a stale output would count.
        self._stale: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        # LoRA (None: off): running requests use at most ``max_loras`` distinct adapters, and
        # a request is admitted only once its adapter is in host memory (``lora_ready``, set
        # by the engine core each step); others wait without blocking the queue.
        self.max_loras = max_loras
        self.lora_ready: set[int] = set()

    # --- requests in and out -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if not 0 < req.num_prompt_tokens <= self.max_model_len:
            # The front end checks this; a request that slipped through must not wedge the pool.
            req.status = RequestStatus.FINISHED_ERROR
            self._pending_outputs.append(self._make_output(
                req, [], error=f"prompt of {req.num_prompt_tokens} tokens; it must have 1 to "
                               f"max_model_len={self.max_model_len}"))
            return
        req.status = RequestStatus.WAITING
        req.schedule_key = schedule_key(req.priority, req.arrival_time, next(self._arrival_seq),
                                        self.config.priority_aging_interval)
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_requests(self, req_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       ) -> list[EngineCoreOutput]:
        """Finish requests now and free their blocks; unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"abort status must be a finished status, got {status.name}")
        reqs = [self.requests[r] for r in dict.fromkeys(req_ids) if r in self.requests]
        self._remove_from_queues({req.request_id for req in reqs})
        outputs = []
        for req in reqs:
            self._finish(req, status)
            outputs.append(self._make_output(req, []))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def _blocks_per_request(self, window: int | None, max_model_len: int,
                            max_num_batched_tokens: int) -> int:
        """The most blocks one request holds in a KV cache group with ``window``: the whole
        context, or only its window and a step's tokens."""
        need = cdiv(max_model_len, self.block_size)
        if window is not None:
            need = min(need, cdiv(window - 1 + max_num_batched_tokens, self.block_size) + 1)
        return need

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- schedule ------------------------------------------------------------------------------

    def schedule(self, skip: Collection[str] = (),
                 max_num_reqs: int | None = None) -> SchedulerOutput:
        """The next step. Pipeline parallelism: ``skip`` are requests in a step still in flight
        (they wait for its token), ``max_num_reqs`` caps this micro-batch's requests. (A request
        with a grant not applied yet waits anyway, unless ``_may_overlap``.)"""
        self._expire_queued()
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        encoder = EncoderBudget(self.config.max_num_encoder_tokens_per_step)
        room = self.config.max_num_seqs if max_num_reqs is None else max_num_reqs
        granted = self.spec_policy.choose_grants(self.running, budget, room, skip)
        i = 0
        while i < len(self.running) and budget > 0 and room > 0:
            req = self.running[i]
            if req.request_id in skip or (req.request_id in self._in_flight
                                          and not self._may_overlap(req)):
                i += 1
                continue
            start = self._scheduled_end(req)
            known = req.num_tokens + self._num_placeholders(req)
            num_new = min(known - start, budget)
            if num_new > 0:
                num_new = encoder.cut(req, start, num_new, just_admitted=False)
            if num_new <= 0:
                i += 1
                continue
            samples = start + num_new >= known
            pending = start + num_new > req.num_tokens  # runs on its in-flight token
            spec = spec_decode.NO_GRANT
            if samples and (
                    granted is None or req.request_id in granted):
                spec = spec_decode.grant(req, budget - num_new, self.max_model_len)
                if req.grammar is not None and spec.num_tokens:
                    cut = spec_decode.grammar_cut(req, spec)
                    if not cut.num_tokens:  # nothing valid: a rejection, as far as the
                        spec_decode.evidence(req, spec.num_tokens, 0)  # estimate goes
                    spec = cut
            new_blocks = self._allocate_or_preempt(
                req, start - req.num_computed_tokens + num_new + spec.num_tokens
                + self._lookahead(req, num_new + spec.num_tokens), out.preempted_req_ids)
            if new_blocks is None:
                break  # ``req`` was the newest and preempted itself
            if spec.num_tokens:
                num_new += spec.num_tokens
                if spec.tokens:
                    out.scheduled_spec_tokens[req.request_id] = spec.tokens
                else:
                    out.scheduled_spec_tree[req.request_id] = spec.tree
            out.scheduled_cached_reqs.append(CachedRequestData(
                req.request_id, req.all_token_ids[self._runner_num_tokens[req.request_id]:],
                new_blocks[0], start, tuple(new_blocks[1:]), pending_token=pending))
            self._runner_num_tokens[req.request_id] = req.num_tokens
            self._in_flight.setdefault(req.request_id, deque()).append((num_new, samples))
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            room -= 1
            i += 1

        if not out.preempted_req_ids:
            budget = self._admit_waiting(out, budget, room, skip, encoder)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        if out.total_num_scheduled_tokens:
            self.num_steps += 1
        if self.num_lookahead_slots:
            out.spec_propose = self.spec_policy.choose_proposers(
                [self.requests[r] for r, n in out.num_scheduled_tokens.items()
                 if self.requests[r].num_computed_tokens + n >= self.requests[r].num_tokens])
        return out

    def _scheduled_end(self, req: Request) -> int:
        """Tokens computed once the request's grants in flight are applied."""
        return req.num_computed_tokens + sum(n for n, _ in self._in_flight.get(req.request_id, ()))

    def _num_placeholders(self, req: Request) -> int:
        """Tokens its steps in flight sample: known to the device, not yet to us."""
        return sum(samples for _, samples in self._in_flight.get(req.request_id, ()))

    def _may_overlap(self, req: Request) -> bool:
        """--async_scheduling: whether a request with a step in flight may be scheduled again
        now (its input token then comes from that step's sampled ids on the device). Not when
        that step's token is known to be its last, nor when its next step needs the token on
        the host: a grammar's mask, penalties over the output tokens. One step ahead at most."""
        if not self.config.async_scheduling or len(self._in_flight[req.request_id]) > 1:
            return False
        pending = self._num_placeholders(req)
        if (req.num_output_tokens + pending >= req.max_tokens
                or req.num_tokens + pending >= self.max_model_len):
            return False
        params = req.sampling_params
        return req.grammar is None and not (params.repetition_penalty != 1.0
                                            or params.presence_penalty != 0.0
                                            or params.frequency_penalty != 0.0)

    def _allocate_or_preempt(self, req: Request, num_new: int,
                             preempted: set[str]) -> list[list[int]] | None:
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is req:
                return None

    def _lookahead(self, req: Request, num_scheduled: int) -> int:
        """KV positions past the scheduled ones that the sps draft writes when the request
        samples this step (never past the context length)."""
        if not self.num_lookahead_slots or (req.num_computed_tokens + num_scheduled
                                            < req.num_tokens):
            return 0
        end = req.num_computed_tokens + num_scheduled
        return max(0, min(self.num_lookahead_slots, self.max_model_len - end))

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids, req.spec_tree_size = [], 0
        req.spec_stats.draft_known = 0  # the runner drops the draft's state with the request
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_num_tokens.pop(req.request_id, None)
        num_in_flight = len(self._in_flight.pop(req.request_id, ()))
        if num_in_flight:
            self._stale[req.request_id] = num_in_flight
        self.waiting.prepend([req])

    def _forget_grant(self, req_id: str) -> None:
        """One in-flight step of a preempted request is back (its output ignored), or its
        grant was taken back before the step was published."""
        left = self._stale.get(req_id, 0) - 1
        if left > 0:
            self._stale[req_id] = left
        else:
            self._stale.pop(req_id, None)

    def _make_room(self, req: Request, num_tokens: int, hit_blocks: list[list[int]], room: int,
                   out: SchedulerOutput) -> tuple[int, int] | None:
        """Priority scheduling: preempt the fewest running requests from the end of ``running``
        (the largest keys, all after ``req``) that free what ``req`` lacks to start with
        ``num_tokens``: blocks, a sequence slot (``max_num_seqs``), a place in this step's
        batch (``room``: one of them must have been granted this step); their grants of this
        step are taken back. Returns the (tokens, requests) granted to them this step, or
        None, preempting nothing, when the requests after ``req`` cannot free enough. (The
        step's token budget is not taken back for itself: that would throw away prefills.)"""
        kv = self.kv_cache_manager
        num_short = kv.num_blocks_short(req, num_tokens, hit_blocks)
        needs_slot = len(self.running) >= self.config.max_num_seqs
        needs_room = room <= 0
        victims: list[Request] = []
        for victim in reversed(self.running):
            if num_short <= 0 and not needs_slot and not needs_room:
                break
            if victim.schedule_key <= req.schedule_key:
                return None
            victims.append(victim)
            needs_slot = False
            needs_room = needs_room and victim.request_id not in out.num_scheduled_tokens
            num_short -= kv.num_freed_by_preempting(victim.request_id, hit_blocks)
        if num_short > 0 or needs_slot or needs_room:
            return None
        num_granted = num_reqs = 0
        for victim in victims:
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted_req_ids.add(victim.request_id)
            granted = out.num_scheduled_tokens.pop(victim.request_id, 0)
            if granted:
                self._forget_grant(victim.request_id)
                num_granted, num_reqs = num_granted + granted, num_reqs + 1
                out.scheduled_cached_reqs = [c for c in out.scheduled_cached_reqs
                                             if c.req_id != victim.request_id]
                out.scheduled_spec_tokens.pop(victim.request_id, None)
                out.scheduled_spec_tree.pop(victim.request_id, None)
        return num_granted, num_reqs

    def _start_running(self, req: Request) -> None:
        if self.priority:
            bisect.insort(self.running, req, key=lambda r: r.schedule_key)
        else:
            self.running.append(req)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, room: int,
                       skip: Collection[str], encoder: EncoderBudget) -> int:
        kv = self.kv_cache_manager
        held_back: list[Request] = []
        running_loras = self._running_loras()
        max_num_seqs = self.config.max_num_seqs
        # Under priority a full batch does not end admission: ``_make_room`` may preempt.
        while self.waiting and budget > 0 and (
                self.priority or (room > 0 and len(self.running) < max_num_seqs)):
            req = self.waiting.peek()
            if (req.request_id in skip or req.request_id in self._stale
                    # Preempted while a step of it is still in flight: resumed once that
                    # step's (ignored) result is back, or the stale result would count.
                    or req.request_id in out.preempted_req_ids  # just now, for another
                    or (req.grammar is not None and not req.grammar.is_ready())  # compiling
                    or (req.lora_id and self._lora_must_wait(req.lora_id, running_loras))):
                held_back.append(self.waiting.pop())  # others go first
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            if kv.pending_owner(req, num_hit // self.block_size) is not None:
                held_back.append(self.waiting.pop())
                continue
            num_new = min(req.num_tokens - num_hit, budget)
            if req.mm_items:
                num_new = encoder.cut(req, num_hit, num_new, just_admitted=True)
                if num_new <= 0:
                    break  # the encoder budget is spent: queue order, as for blocks
            lookahead = self._lookahead_new(req, num_hit, num_new)
            if self.priority:  # out of blocks or sequence slots: preempt requests after it
                freed = self._make_room(req, num_new + lookahead, hit_blocks, room, out)
                if freed is None:
                    break  # queue order: later requests do not jump it
                budget, room = budget + freed[0], room + freed[1]
            new_blocks = kv.allocate_slots(req, num_new + lookahead, hit_blocks)
            if new_blocks is None:
                break  # queue order: later requests do not jump a request that needs blocks
            self.waiting.pop()
            kv.record_prefix_lookup(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self._queued_time[req.request_id] = max(self.clock() - req.arrival_time, 0.0)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self._start_running(req)
            out.scheduled_new_reqs.append(
                NewRequestData.of(req, kv.get_group_block_ids(req.request_id), num_hit))
            if req.lora_id:
                running_loras.add(req.lora_id)
            self._runner_num_tokens[req.request_id] = req.num_tokens
            self._in_flight[req.request_id] = deque([(num_new, num_hit + num_new
                                                      >= req.num_tokens)])
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            room -= 1
        self.waiting.prepend(held_back)
        return budget

    def _lookahead_new(self, req: Request, num_hit: int, num_new: int) -> int:
        if not self.num_lookahead_slots or num_hit + num_new < req.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_slots, self.max_model_len - num_hit - num_new))

    def _running_loras(self) -> set[int]:
        if self.max_loras is None:
            return set()
        return {r.lora_id for r in self.running if r.lora_id}

    def _lora_must_wait(self, lora_id: int, running_loras: set[int]) -> bool:
        if self.max_loras is None:
            return False
        if lora_id not in self.lora_ready:
            return True
        return lora_id not in running_loras and len(running_loras) >= self.max_loras

    def wanted_loras(self) -> dict[int, object]:
        """The adapter of every unfinished request, by id (its ``LoRARequest``)."""
        return {r.lora_id: r.lora_request for r in self.requests.values() if r.lora_id}

    def fail_lora(self, lora_id: int, error: str) -> list[EngineCoreOutput]:
        """Fail every unfinished request of an adapter that cannot be loaded."""
        req_ids = [r.request_id for r in self.requests.values() if r.lora_id == lora_id]
        outputs = self.abort_requests(req_ids, RequestStatus.FINISHED_ERROR)
        for output in outputs:
            output.error, output.error_kind = error, ErrorKind.FAILED
        return outputs

    def _expire_queued(self) -> None:
        max_time = self.config.max_queue_time
        if max_time is None or not self.waiting:
            return
        now = self.clock()
        expired = [r for r in self.waiting if r.status == RequestStatus.WAITING
                   and now - r.arrival_time > max_time]
        if not expired:
            return
        self._remove_from_queues({r.request_id for r in expired})
        for req in sorted(expired, key=lambda r: r.schedule_key):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            output = self._make_output(req, [], error=QUEUE_TIMEOUT_ERROR,
                                       error_kind=ErrorKind.QUEUE_TIMEOUT)
            output.queued_time = now - req.arrival_time
            self._pending_outputs.append(output)

    # --- update --------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if sched.grammar_bitmask is not None:
            # The mask fill consumes and rolls back speculative tokens in the matchers: let it
            # finish before the grammars advance below (the runner has normally waited already).
            sched.grammar_bitmask.wait()  # a failed fill was the step's error, not ours
        sampled = dict(zip(out.req_ids, out.sampled_token_ids))
        finished: set[str] = set()
        verified = False
        for req_id, num_scheduled in sched.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:
                continue  # finished or aborted since it was scheduled
            if req.status != RequestStatus.RUNNING:
                self._forget_grant(req_id)  # preempted since: its output is stale
                continue
            self._pop_grant(req_id)
            error = out.errored.get(req_id)
            error_kind = ErrorKind.FAILED
            new_tokens: list[int] = []
            if error is None:
                tokens = sampled.get(req_id) or []
                new_tokens = self._append_tokens(req, tokens)
                # KV of proposals is kept only for accepted chain tokens that were emitted;
                # the rest (rejected tokens, look_ahead trees) is rolled back.
                spec = sched.scheduled_spec_tokens.get(req_id, ())
                tree = sched.scheduled_spec_tree.get(req_id, 0)
                num_rolled_back = len(spec) + tree
                if spec or tree:
                    num_accepted = max(len(tokens) - 1, 0)
                    self._record_spec(req, len(spec) or self.spec_policy.tree_guess_len,
                                      num_accepted)
                    verified = True
                    if spec:
                        num_rolled_back -= min(num_accepted, len(new_tokens))
                elif tokens:
                    spec_decode.idle(req)
                self._advance(req, num_scheduled - num_rolled_back)
                if not req.is_finished:
                    req.spec_token_ids = out.spec_token_ids.get(req_id, [])
                    req.spec_tree_size = out.spec_tree_sizes.get(req_id, 0)
                if not new_tokens and req.num_computed_tokens >= req.num_tokens:
                    error = "the model runner returned no token for a finished prefill"
                if (req.grammar is not None and not req.is_finished
                        and len(new_tokens) < len(tokens)):
                    error_kind, error = stop_rules.grammar_rejection(req, tokens[len(new_tokens)])
            done = error is not None or req.is_finished
            if done:
                self._finish(req, req.status if error is None else RequestStatus.FINISHED_ERROR)
                finished.add(req_id)
            if new_tokens or done:
                outputs.append(self._make_output(req, new_tokens, out.logprobs.get(req_id), error,
                                                 error_kind))
        if not verified:
            self.spec_policy.idle()
        self._remove_from_queues(finished)
        unscheduled_errors = [r for r in out.errored
                              if r not in sched.num_scheduled_tokens and r in self.requests]
        for req_id in unscheduled_errors:
            outputs.extend(self.abort_requests([req_id], RequestStatus.FINISHED_ERROR))
            outputs[-1].error, outputs[-1].error_kind = out.errored[req_id], ErrorKind.FAILED
        return outputs

    def _pop_grant(self, req_id: str) -> None:
        grants = self._in_flight.get(req_id)
        if grants:
            grants.popleft()
            if not grants:
                del self._in_flight[req_id]

    def runner_knows_all(self, req_ids: Iterable[str]) -> None:
        """The runner was sent these requests in full (a failed step's re-runs): their next
        diffs start after every token known now."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and req_id in self._runner_num_tokens:
                self._runner_num_tokens[req_id] = req.num_tokens

    def discard_grants(self, sched: SchedulerOutput, req_ids: Collection[str]) -> None:
        """--async_scheduling: drop ``req_ids``' grants in ``sched`` (published, not applied)
        because the step before it failed: its input tokens came from that step's sampled ids.
        Their output in ``sched`` is ignored and they are scheduled again from the state the
        failed step's recovery leaves them in (the runner re-learns them in full)."""
        for req_id in req_ids:
            if sched.num_scheduled_tokens.pop(req_id, None) is None:
                continue
            grants = self._in_flight.get(req_id)
            if grants:
                grants.pop()
                if not grants:
                    del self._in_flight[req_id]
            elif req_id in self._stale:
                self._forget_grant(req_id)
        sched.scheduled_cached_reqs = [c for c in sched.scheduled_cached_reqs
                                       if c.req_id in sched.num_scheduled_tokens]

    def _record_spec(self, req: Request, num_proposed: int, num_accepted: int) -> None:
        spec_decode.record(req, num_proposed, num_accepted)
        self.spec_policy.record(num_proposed, num_accepted)
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_proposed
        self.num_spec_accepted_tokens += num_accepted

    def _advance(self, req: Request, num_scheduled: int) -> None:
        self.num_prompt_tokens += max(0, min(num_scheduled,
                                             req.num_prompt_tokens - req.num_computed_tokens))
        req.num_computed_tokens += num_scheduled
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)

    def _append_tokens(self, req: Request, token_ids: list[int]) -> list[int]:
        appended = stop_rules.append_tokens(req, token_ids, self.eos_token_ids,
                                            self.max_model_len)
        self.num_generation_tokens += len(appended)
        return appended

    # --- finishing -----------------------------------------------------------------------------

    def _remove_from_queues(self, req_ids: set[str]) -> None:
        if not req_ids:
            return
        if any(r.request_id in req_ids for r in self.running):
            self.running = [r for r in self.running if r.request_id not in req_ids]
        if any(r.request_id in req_ids for r in self.waiting):
            self.waiting.remove(req_ids)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and return its blocks; the caller takes it out of the queues."""
        req.status = status
        self.kv_cache_manager.free(req)
        self.requests.pop(req.request_id, None)
        self._runner_num_tokens.pop(req.request_id, None)
        self._in_flight.pop(req.request_id, None)
        self._stale.pop(req.request_id, None)
        self._finished_req_ids.add(req.request_id)

    def _make_output(self, req: Request, new_token_ids: list[int],
                     logprobs: Logprobs | None = None,
                     error: str | None = None,
                     error_kind: ErrorKind = ErrorKind.FAILED) -> EngineCoreOutput:
        output = EngineCoreOutput(request_id=req.request_id, new_token_ids=new_token_ids,
                                  error=error, error_kind=None if error is None else error_kind)
        if logprobs is not None and new_token_ids:
            output.new_logprobs = logprobs.head(len(new_token_ids))
        if req.is_finished:
            output.finish_reason = req.status.finish_reason
            output.stop_reason = req.stop_reason
            output.grammar_complete = req.grammar_complete
            output.num_draft_tokens = req.spec_stats.num_draft_tokens
            output.num_accepted_tokens = req.spec_stats.num_accepted_tokens
        queued_time = self._queued_time.pop(req.request_id, None)
        if queued_time is not None:
            output.num_cached_tokens = max(req.num_cached_tokens, 0)
            output.queued_time = queued_time
        return output

    def reset_prefix_cache(self) -> int:
        """Forget cached blocks no request holds (e.g. after swapping weights); returns how many."""
        return self.kv_cache_manager.reset_prefix_cache()

    # --- observability -------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage, num_used_blocks=kv.pool.num_used_blocks,
            num_total_blocks=kv.pool.num_usable_blocks,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens, num_steps=self.num_steps,
            num_spec_drafts=self.num_spec_drafts,
            num_spec_declined=dict(self.spec_policy.num_declined),
            num_spec_draft_tokens=self.num_spec_draft_tokens,
            num_spec_accepted_tokens=self.num_spec_accepted_tokens)

    def check_invariants(self) -> None:
        """Block accounting plus queue consistency; raises ``BlockAccountingError``."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        _require(len(running) == len(self.running), "a request is twice in running")
        _require(len(waiting) == len(self.waiting), "a request is twice in waiting")
        _require(not running & waiting, "a request is both running and waiting")
        _require(running | waiting == set(self.requests), "queues and request map disagree")
        _require(set(kv.req_to_blocks) == running, "a request holds blocks but is not running")
        _require(set(self._in_flight) <= running, "a grant in flight for a request not running")
        _require(set(self._stale) <= waiting, "a stale grant for a request not waiting")
        _require(len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs")
        _require(not self.priority or all(a.schedule_key < b.schedule_key for a, b
                                          in zip(self.running, self.running[1:])),
                 "running is out of priority order")
        for req in self.running:
            _require(req.status == RequestStatus.RUNNING, f"{req} in running")
            _require(req.num_computed_tokens <= req.num_tokens, f"{req} computed too much")
            _require(len(kv.get_block_ids(req.request_id))
                     >= cdiv(req.num_computed_tokens, self.block_size),
                     f"{req} has fewer blocks than computed tokens")
        for req in self.waiting:
            _require(req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED),
                     f"{req} in waiting")
            _require(req.num_computed_tokens == 0, f"{req} waiting with computed tokens")
