"""A failed step fails only its culprit(s): re-run the step's requests in smaller groups until
the ones that make it raise are found; everyone else gets this step's tokens as usual.

Invariant that makes a re-run safe: the scheduler advances a request only in
``update_from_output``, so when a step raises every request of it is still in its pre-step state
(tokens, ``num_computed_tokens``, the blocks granted for this step). The workers' view may be
half-updated, so before a re-run they forget the group's requests (``drop_requests``) and get
each one back in full, as a resumed request (``NewRequestData``). Re-writing KV at positions
>= ``num_computed_tokens`` is idempotent: those blocks are the request's own, never shared.

Pipeline parallelism: a failed micro-batch is recovered only once the micro-batches published
after it are finished (the engine core collects them first), so the re-runs have the pipeline to
themselves. Those later micro-batches never hold a request of the failed one (a request in
flight is not scheduled again), but between scheduling and recovery one of the failed step's
requests may have been aborted or preempted (its blocks freed): it is not re-run. A request the
failed step preempted may have been resumed by a later micro-batch: the workers keep it
(``in_later_steps``).

Search order: first the step without its suspects (requests newly admitted or resumed this
step, or whose prefill is still running: what changed since the last good step); if that runs,
only the suspects are bisected. With ``k`` culprits among ``n`` requests it takes about
``k * log2(n)`` re-runs; a fault that does not repeat (the whole set runs the second time) fails
nobody.

Recovery's own failures (a rank's ``drop_requests`` raising, a re-run that cannot be built) are
the engine's, not the requests': the search stops, the step's requests not yet answered fail
with an error saying so, and the engine goes on. A dead worker (``fatal``) still propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from bladellm.core.interface import ModelRunnerOutput, NewRequestData, SchedulerOutput
from bladellm.core.scheduler import Scheduler
from bladellm.request import RequestStatus

logger = logging.getLogger(__name__)

RunStep = Callable[[SchedulerOutput], ModelRunnerOutput]
DropRequests = Callable[[list[str]], None]


def suspects_of(sched: SchedulerOutput, scheduler: Scheduler) -> set[str]:
    """The step's requests that changed since the last good step: admitted or resumed now, or
    still in their prompt's prefill."""
    ids = {new.req_id for new in sched.scheduled_new_reqs}
    for req_id in sched.num_scheduled_tokens:
        req = scheduler.requests.get(req_id)
        if req is not None and req.num_computed_tokens < req.num_prompt_tokens:
            ids.add(req_id)
    return ids


def sub_step(sched: SchedulerOutput, req_ids: list[str], scheduler: Scheduler) -> SchedulerOutput:
    """``sched`` restricted to ``req_ids``, each sent in full (the workers dropped them)."""
    out = SchedulerOutput(grammar_bitmask=sched.grammar_bitmask)
    kv = scheduler.kv_cache_manager
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        # The draft's state went with the request: like a preemption, it starts over.
        req.spec_stats.draft_known = 0
        out.scheduled_new_reqs.append(
            NewRequestData.of(req, kv.get_group_block_ids(req_id), req.num_computed_tokens))
        out.num_scheduled_tokens[req_id] = sched.num_scheduled_tokens[req_id]
        if req_id in sched.scheduled_spec_tokens:
            out.scheduled_spec_tokens[req_id] = sched.scheduled_spec_tokens[req_id]
        if req_id in sched.scheduled_spec_tree:
            out.scheduled_spec_tree[req_id] = sched.scheduled_spec_tree[req_id]
    out.spec_propose = sched.spec_propose & set(req_ids)
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def merge(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    for out in outputs:
        merged.req_ids.extend(out.req_ids)
        merged.sampled_token_ids.extend(out.sampled_token_ids)
        merged.logprobs.update(out.logprobs)
        merged.prompt_logprobs.update(out.prompt_logprobs)
        merged.errored.update(out.errored)
        merged.spec_token_ids.update(out.spec_token_ids)
        merged.spec_tree_sizes.update(out.spec_tree_sizes)
    return merged


class StepIsolation:
    """Re-runs a failed step in groups (see the module docstring). ``run`` executes a step and
    raises what the workers raised; ``drop`` makes the workers forget requests. Exceptions
    that ``fatal`` matches (a dead worker) end the search and propagate."""

    def __init__(self, scheduler: Scheduler, run: RunStep, drop: DropRequests,
                 fatal: tuple[type[BaseException], ...] = ()) -> None:
        self.scheduler, self.run, self.drop, self.fatal = scheduler, run, drop, fatal

    def recover(self, sched: SchedulerOutput, exc: Exception,
                in_later_steps: Collection[str] = ()) -> ModelRunnerOutput:
        """``in_later_steps``: requests of micro-batches published after ``sched`` (already
        finished on the workers); the workers must not forget them."""
        # Only requests still running are re-run: one aborted or preempted since the step was
        # scheduled (pipeline parallelism) no longer owns its blocks, and its results would be
        # ignored anyway.
        req_ids = [r for r in sched.num_scheduled_tokens if self._is_running(r)]
        outputs: list[ModelRunnerOutput] = []
        culprits: dict[str, str] = {}
        try:
            # The workers forget the step's requests (they are sent again in full) and, if the
            # step never reached them, the finished and preempted ones it was to tell them about.
            self.drop(sorted((set(sched.num_scheduled_tokens) | sched.finished_req_ids
                              | sched.preempted_req_ids) - set(in_later_steps)))
            self._isolate(sched, exc, req_ids, outputs, culprits)
        except self.fatal:
            raise
        except Exception as engine_exc:  # noqa: BLE001 - recovery's own failure, not theirs
            # Dropping requests on a rank or building a re-run failed: an engine-side error the
            # step's requests did not cause. The search cannot go on (the workers' view of the
            # requests is unknown), so those without their tokens yet fail, and the engine lives.
            answered = {r for out in outputs for r in out.req_ids} | set(culprits)
            rest = [r for r in req_ids if r not in answered]
            logger.error("engine error while re-running a failed step (%s: %s); failing its "
                         "%d requests not yet re-run (their error is the engine's, not theirs)",
                         type(engine_exc).__name__, engine_exc, len(rest), exc_info=engine_exc)
            culprits.update((r, f"engine error while recovering from a failed step: "
                                f"{type(engine_exc).__name__}: {engine_exc}") for r in rest)
        else:
            if culprits:
                logger.error("step failed; %d of its %d requests cause it and finish with the "
                             "error (%s); the others go on", len(culprits), len(req_ids),
                             ", ".join(sorted(culprits)))
            elif not req_ids:
                logger.warning("step failed (%s: %s); its requests were all gone (aborted or "
                               "preempted) before a re-run, so none was re-run",
                               type(exc).__name__, exc)
            else:
                logger.warning("step failed (%s: %s) but its requests ran when re-run; none "
                               "failed", type(exc).__name__, exc)
        merged = merge(outputs)
        merged.req_ids.extend(culprits)
        merged.sampled_token_ids.extend([] for _ in culprits)
        merged.errored.update(culprits)
        return merged

    def _isolate(self, sched: SchedulerOutput, exc: Exception, req_ids: list[str],
                 outputs: list[ModelRunnerOutput], culprits: dict[str, str]) -> None:
        suspects = suspects_of(sched, self.scheduler)
        innocent = [r for r in req_ids if r not in suspects]
        if innocent and len(innocent) < len(req_ids):
            self._search(sched, innocent, None, outputs, culprits)
            self._search(sched, [r for r in req_ids if r in suspects], None, outputs, culprits)
        elif req_ids:
            # The whole step failed together, unless some of it is gone: then what is left
            # has not been seen failing on its own yet.
            known_failing = len(req_ids) == len(sched.num_scheduled_tokens)
            self._search(sched, req_ids, exc if known_failing else None, outputs, culprits)

    def _is_running(self, req_id: str) -> bool:
        req = self.scheduler.requests.get(req_id)
        return req is not None and req.status == RequestStatus.RUNNING

    def _search(self, sched: SchedulerOutput, group: list[str], error: Exception | None,
                outputs: list[ModelRunnerOutput], culprits: dict[str, str]) -> None:
        """Run ``group`` (unless ``error`` says it already failed together); a group that fails
        is halved until each part runs or is one request, which is then a culprit."""
        if error is None:
            error = self._run(sched, group, outputs)
            if error is None:
                return
        if len(group) == 1:
            logger.error("request %s fails the step:", group[0], exc_info=error)
            culprits[group[0]] = f"{type(error).__name__}: {error}"
            return
        half = len(group) // 2
        self._search(sched, group[:half], None, outputs, culprits)
        self._search(sched, group[half:], None, outputs, culprits)

    def _run(self, sched: SchedulerOutput, group: list[str],
             outputs: list[ModelRunnerOutput]) -> Exception | None:
        # Built outside the guard: an error here is the engine's (``recover`` handles it), not
        # the group's.
        step = sub_step(sched, group, self.scheduler)
        try:
            outputs.append(self.run(step))
            return None
        except self.fatal:
            raise
        except Exception as exc:  # noqa: BLE001 - the search goes on in smaller groups
            error = exc
        self.drop(group)  # outside the guard too: a failed drop is the engine's error
        return error
