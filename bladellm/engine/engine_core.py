"""The engine core: schedule → execute → update, in-process or in its own process.

``EngineCore`` is the step loop's body, used directly by the offline ``LLM`` and tests.
``run_engine_core_proc`` wraps it in a busy loop behind two ZMQ sockets for ``AsyncLLM``.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Collection

from bladellm.config import EngineConfig
from bladellm.core import spec_decode
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.core.kv_groups import engine_kv_cache_groups
from bladellm.core.scheduler import Scheduler
from bladellm.core.step_phases import PhaseClock
from bladellm.executor import WorkerDiedError, get_executor_class
from bladellm.executor.base import DoneStep, StepHandle
from bladellm.engine.guided import GuidedRequests
from bladellm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from bladellm.checkpoint.attention_layout import layer_windows
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.engine.prompt_logprobs import PromptLogprobs
from bladellm.engine.step_isolation import StepIsolation
from bladellm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def _check_draft(config: EngineConfig, resolved: ResolvedModel):
    """The sps draft's HF config, after checking that it shares the target's vocabulary."""
    from bladellm.model.loader import resolve_model
    from bladellm.spec_decode.draft_model import check_draft_vocab, draft_model_config

    draft = resolve_model(draft_model_config(config, resolved.max_model_len, resolved.dtype),
                          snapshot_config=True)
    check_draft_vocab(resolved.hf_config, draft.hf_config, draft.path)
    return draft.hf_config


def _log_draft_outlook(break_even: float | None) -> None:
    """Say at start-up when the cost rule will rarely or never run the sps draft (a user who
    turned sps on otherwise sees no speculation and no reason)."""
    if break_even is None:
        return
    if break_even >= 1.0:
        logger.warning("sps: the draft will never run: with this draft/target cost ratio, "
                       "--spec_policy cost finds plain decoding faster even if every proposed "
                       "token were accepted (a smaller draft, or --spec_policy always, runs it); "
                       "declined drafts are counted in /metrics "
                       "(bladellm_spec_decode_declined_total)")
    elif break_even > 0.5:
        logger.warning("sps: the draft runs only for requests expected to accept more than "
                       "%.0f%% of its tokens (a new request is assumed to accept 50%%), so it "
                       "may rarely run; declined drafts are counted in /metrics "
                       "(bladellm_spec_decode_declined_total, by reason)", 100 * break_even)
    else:
        logger.info("sps: the draft runs for requests expected to accept more than %.0f%% of "
                    "its tokens", 100 * break_even)


class EngineCore:
    @staticmethod
    def _kv_group_windows(config: EngineConfig, resolved: ResolvedModel) -> list[int | None]:
        """The window (None: global) of each KV cache group (core/kv_groups.py); the runner
        lays its KV tensors out from the same groups."""
        return engine_kv_cache_groups(layer_windows(resolved.hf_config),
                                      config.cache.disable_hybrid_kv_cache,
                                      config.speculative.decode_algo).windows

    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.config = config
        self.max_model_len = resolved.max_model_len
        draft_hf_config = None
        if config.speculative.decode_algo == "sps":
            draft_hf_config = _check_draft(config, resolved)  # before any weights load
        self.executor = get_executor_class(config)(config, resolved)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(num_blocks)
            self.lora_enabled = config.lora.enable_lora
            self.scheduler = Scheduler(
                config.scheduler, config.cache, num_blocks, self.max_model_len,
                speculative=config.speculative,
                spec_costs=(spec_decode.model_costs(
                    config, resolved.hf_config, draft_hf_config,
                    self._measured_draft_ratio()
                    if draft_hf_config is not None and config.speculative.spec_policy == "cost"
                    else None)
                    if config.speculative.enabled else None),
                max_loras=config.lora.max_loras if self.lora_enabled else None,
                kv_group_windows=self._kv_group_windows(config, resolved))
            self.num_blocks = num_blocks
            if self.scheduler.spec_policy.costs is not None:
                c = self.scheduler.spec_policy.costs
                logger.info("speculation: --spec_policy %s, step overhead %.1f tokens, LM-head "
                            "share %.2f, draft/target cost %.2f", config.speculative.spec_policy,
                            c.step_overhead, c.lm_head_share, c.draft_ratio)
                _log_draft_outlook(self.scheduler.spec_policy.draft_break_even())
            self.guided = GuidedRequests(config, resolved, self.scheduler)
            self.prompt_logprobs = PromptLogprobs()
            self.phases = PhaseClock()  # where the steps' time goes (core/step_phases.py)
            # Published steps not finished yet (pipeline parallelism, --async_scheduling), oldest
            # first, and how many may be: the pipeline depth, or 2 when step n + 1 is scheduled
            # and launched while step n runs (docs/scheduler.md).
            self.batch_queue: deque[tuple[SchedulerOutput, StepHandle | Exception]] = deque()
            self.overlap = config.scheduler.async_scheduling
            self.max_in_flight = 2 if self.overlap else self.executor.max_concurrent_batches
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise

    def _measured_draft_ratio(self) -> float:
        """sps: a draft forward's time over the target's, timed on the driver at start-up."""
        target_s, draft_s = self.executor.collective_rpc("spec_forward_times")[
            self.executor.driver_rank]
        logger.info("sps: one-token forward %.1f ms target, %.1f ms draft", target_s * 1e3,
                    draft_s * 1e3)
        return draft_s / target_s

    def shutdown(self) -> None:
        """Stop the workers (world size > 1: their processes)."""
        self.executor.shutdown()

    def set_eos_token_ids(self, eos_token_ids: list[int]) -> None:
        """The model's end-of-sequence ids (``ModelInfo.eos_token_ids``: generation config and
        tokenizer), handed once at start-up, before any request: the scheduler stops on them,
        the runner bans them below ``min_tokens``. The front end knows them (it loads the
        tokenizer, which this process never does)."""
        self.scheduler.eos_token_ids = frozenset(eos_token_ids)
        self.executor.collective_rpc("set_eos_token_ids", (list(eos_token_ids),))

    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            max_model_len=self.max_model_len,
            arrival_time=req.arrival_time or None,
            lora_request=req.lora_request, priority=req.priority, mm_items=req.mm_items)
        if req.sampling_params.guided_decoding is not None:
            request.grammar = self.guided.grammar_for(req.sampling_params.guided_decoding)
        if req.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.expect(req.request_id)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.prompt_logprobs.drop(request_ids)
        return self.scheduler.abort_requests(request_ids)

    def embed(self, prompts: list[list[int]], pooling: str) -> list[list[float]]:
        """Embeddings of token-id prompts, outside the scheduler (they hold no KV blocks)."""
        return self.executor.collective_rpc("embed", (prompts, pooling))[
            self.executor.driver_rank]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        clock = self.phases
        start = time.perf_counter()
        lora_failures, loading = self._sync_loras() if self.lora_enabled else ([], False)
        failed = self.guided.fail_broken_grammars()
        if self.max_in_flight > 1:
            scheduling = clock.seconds.get("schedule", 0.0)
            sched, runner_out = self._pipelined_step()
            scheduling = clock.seconds.get("schedule", 0.0) - scheduling  # timed inside
            start = self._count_execute(runner_out, start + scheduling)
        else:
            sched = self.scheduler.schedule()
            sched.grammar_bitmask = self.guided.start_bitmask(sched)
            if sched.is_empty:
                if loading:
                    time.sleep(0.002)  # only requests waiting for an adapter load: don't spin
                self.guided.wait_for_compiling()  # only grammar-waiting requests: don't spin
            start = clock.since("schedule", start)
            runner_out = self._execute(sched)
            start = self._count_execute(runner_out, start)
        self._gather_prompt_logprobs(runner_out)
        outputs = (lora_failures + failed
                   + self.scheduler.update_from_output(sched, runner_out))
        if len(self.prompt_logprobs):
            self.prompt_logprobs.attach(outputs)
        if self.config.debug_block_accounting:
            self.scheduler.check_invariants()
        stats = self.scheduler.get_stats()
        self.guided.fill_stats(stats)
        clock.since("update", start)
        stats.step_seconds = clock.snapshot()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def _count_execute(self, runner_out: ModelRunnerOutput, start: float) -> float:
        """The runner's phases, and the rest of the executor's round trip since ``start``."""
        now = time.perf_counter()
        runner = sum(runner_out.phase_seconds.values())
        self.phases.add_all(runner_out.phase_seconds)
        self.phases.add("executor", max(0.0, now - start - runner))
        return now

    def _gather_prompt_logprobs(self, runner_out: ModelRunnerOutput) -> None:
        """Before the scheduler advances: a chunk's prompt logprobs start after the request's
        tokens computed so far. (A request preempted while its step was in flight gets that
        step's results ignored, these too.)"""
        for req_id, chunk in runner_out.prompt_logprobs.items():
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                self.prompt_logprobs.add(req_id, chunk, req.num_computed_tokens)

    def _pipelined_step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Pipeline parallelism: keep up to ``P`` micro-batches in flight, then finish the oldest.

        Schedule: each new micro-batch takes requests that are not in flight (a request needs
        its last token back before it can run again) and at most ``ceil(unfinished / P)`` of
        them, so a full batch is split over the stages instead of filling the first micro-batch
        and leaving the others empty. Stage ``s`` runs micro-batch ``i`` while stage ``s - 1``
        runs ``i + 1``; every rank runs them in publication order.

        --async_scheduling: the same loop at depth 2 over one whole batch: step n + 1 is
        scheduled (its requests in flight on a placeholder for step n's token) and launched
        before step n's sampled ids are read and applied.
        """
        depth = self.max_in_flight
        while len(self.batch_queue) < depth:
            if self.batch_queue and isinstance(self.batch_queue[-1][1], Exception):
                break  # failed before it ran: the tokens its requests wait for are not coming
            in_flight = {r for sched, _ in self.batch_queue for r in sched.num_scheduled_tokens}
            unfinished = self.scheduler.num_running + self.scheduler.num_waiting
            start = time.perf_counter()
            sched = (self.scheduler.schedule() if self.overlap else self.scheduler.schedule(
                skip=in_flight, max_num_reqs=max(1, -(-unfinished // depth))))
            self.phases.since("schedule", start)
            if sched.is_empty and self.batch_queue and not (
                    sched.finished_req_ids or sched.preempted_req_ids):
                break  # nothing new to run (or to tell the workers): wait for the oldest
            if sched.is_empty and not self.batch_queue:
                self.guided.wait_for_compiling()  # only grammar-waiting requests: don't spin
            sched.grammar_bitmask = self.guided.start_bitmask(sched)
            self.batch_queue.append((sched, self._submit(sched)))
            if sched.is_empty:
                break
        sched, handle = self.batch_queue.popleft()
        return sched, self._collect(sched, handle)

    def _submit(self, sched: SchedulerOutput) -> StepHandle | Exception:
        try:
            return self.executor.execute_model_async(sched)
        except WorkerDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - failed before it ran: fail its requests
            return exc

    def _collect(self, sched: SchedulerOutput, handle: StepHandle | Exception) -> ModelRunnerOutput:
        try:
            if isinstance(handle, Exception):
                raise handle
            return handle.result()
        except WorkerDiedError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad batch must not kill the server
            # Re-runs need the pipeline to themselves: let the micro-batches published after
            # this one finish first (their results wait in the queue, applied in order after
            # this one's), then isolate the culprit synchronously.
            self._finish_in_flight()
            if self.overlap:
                # Later steps ran this one's requests on its (failed) sampled ids or KV: their
                # output for those is dropped; recovery re-runs them from their state before it.
                for later_sched, _ in self.batch_queue:
                    self.scheduler.discard_grants(later_sched, sched.num_scheduled_tokens)
            later = {r for s, _ in self.batch_queue for r in s.num_scheduled_tokens}
            return self._fail_step(sched, exc, in_later_steps=later)

    def _finish_in_flight(self) -> None:
        """Wait for every published micro-batch; each keeps its place in the queue with its
        output, or the error it raised (handled when its turn comes)."""
        for i, (sched, handle) in enumerate(list(self.batch_queue)):
            if isinstance(handle, (Exception, DoneStep)):
                continue
            try:
                done: DoneStep | Exception = DoneStep(handle.result())
            except WorkerDiedError:
                raise
            except Exception as exc:  # noqa: BLE001 - its own turn isolates its culprit
                done = exc
            self.batch_queue[i] = (sched, done)

    def _sync_loras(self) -> tuple[list[EngineCoreOutput], bool]:
        """Start disk loads of wanted adapters (off this loop), tell the scheduler which are in
        host memory, fail the requests of adapters that cannot be loaded."""
        wanted = self.scheduler.wanted_loras()
        if not wanted:
            return [], False
        # Every rank keeps its own host tier: an adapter is ready when it is on all of them.
        answers = self.executor.collective_rpc("sync_loras", (list(wanted.values()),))
        ready = set.intersection(*(set(a[0]) for a in answers))
        failed = {lora_id: err for a in answers for lora_id, err in a[1].items()}
        loading = any(a[2] for a in answers) or any(set(a[0]) != ready for a in answers)
        self.scheduler.lora_ready = ready
        outputs: list[EngineCoreOutput] = []
        for lora_id, error in failed.items():
            outputs.extend(self.scheduler.fail_lora(lora_id, error))
        return outputs, loading

    def remove_lora(self, lora_id: int) -> None:
        self.executor.collective_rpc("remove_lora", (lora_id,))

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the batch; if it fails, fail the requests in it rather than the engine."""
        try:
            return self.executor.execute_model(sched)
        except WorkerDiedError:
            raise  # no worker to fail requests on: the engine is dead
        except Exception as exc:  # noqa: BLE001 - one bad batch must not kill the server
            return self._fail_step(sched, exc)

    def _fail_step(self, sched: SchedulerOutput, exc: Exception,
                   in_later_steps: Collection[str] = ()) -> ModelRunnerOutput:
        """The step's culprit(s) finish with its error and the engine goes on: the step is
        re-run in groups to find them (``step_isolation.py``), so that the others get their
        tokens. ``in_later_steps``: requests of finished micro-batches published after it."""
        logger.error("step failed; re-running its %d requests to find the culprit:\n%s",
                     len(sched.num_scheduled_tokens), "".join(traceback.format_exception(exc)))
        out = StepIsolation(self.scheduler, self.executor.execute_model,
                            self.executor.drop_requests,
                            fatal=(WorkerDiedError,)).recover(sched, exc, in_later_steps)
        # The re-runs sent the requests in full, with every token known now (under
        # --async_scheduling more than when the step was scheduled).
        self.scheduler.runner_knows_all(r for r in sched.num_scheduled_tokens
                                        if r not in in_later_steps)
        return out
