"""The engine core's structured-output glue: grammars for new requests, failing requests whose
grammar cannot compile, and this step's bitmask (``bladellm.guided`` does the work).

The manager (and the llguidance tokenizer bridge inside it) is created on the first constrained
request, or at start-up with ``--enable_json_warmup``; servers that never see one pay nothing.
"""

from __future__ import annotations

import json
import logging

from bladellm.config import EngineConfig
from bladellm.core.interface import SchedulerOutput
from bladellm.core.outputs import EngineCoreOutput
from bladellm.core.scheduler import Scheduler
from bladellm.errors import ErrorKind
from bladellm.guided.manager import GrammarState, GuidedDecodingManager, StepBitmask
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.request import RequestStatus
from bladellm.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

# While only grammar-waiting requests are left, wait this long for a compilation per step.
_IDLE_WAIT_S = 0.05


class GuidedRequests:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel,
                 scheduler: Scheduler) -> None:
        self.config = config.guided
        self._resolved = resolved
        self._max_num_seqs = config.scheduler.max_num_seqs
        self.scheduler = scheduler
        self._manager: GuidedDecodingManager | None = None
        if self.config.enable_json_warmup:
            self._warmup()

    @property
    def manager(self) -> GuidedDecodingManager:
        if self._manager is None:
            from bladellm.engine.model_info import model_info_for
            from bladellm.guided.backend import GrammarLimits, LLGuidanceBackend

            resolved, cfg = self._resolved, self.config
            vocab_size = self._vocab_size()

            def backend() -> LLGuidanceBackend:
                info = model_info_for(resolved)
                return LLGuidanceBackend(info.tokenizer, vocab_size, info.eos_token_ids,
                                         GrammarLimits(max_grammar_size=cfg.guided_max_grammar_size))

            self._manager = GuidedDecodingManager(
                backend, vocab_size, self._max_num_seqs, cfg.guided_cache_size,
                cfg.guided_compile_timeout)
        return self._manager

    def _vocab_size(self) -> int:
        from bladellm.checkpoint.model_len import get_text_attr

        return int(get_text_attr(self._resolved.hf_config, ("vocab_size",)))

    def _warmup(self) -> None:
        schemas = [GuidedDecodingParams(json_object=True)]
        for path in self.config.json_warmup_schemas or ():
            try:
                with open(path, encoding="utf-8") as f:
                    schemas.append(GuidedDecodingParams(json=json.load(f)))
            except (OSError, ValueError) as e:
                raise ValueError(f"--json_warmup_schemas: {path}: {e}") from None
        seconds = self.manager.warmup(schemas)
        logger.info("JSON warm-up: %d grammars compiled in %.2f s", len(schemas), seconds)

    def grammar_for(self, params: GuidedDecodingParams) -> GrammarState:
        return self.manager.grammar_for(params)

    def _compiling(self) -> list:
        return [r for r in self.scheduler.waiting
                if r.grammar is not None and not r.grammar.is_ready()]

    def fail_broken_grammars(self) -> list[EngineCoreOutput]:
        """Finish waiting requests whose grammar failed to compile (error: a 400 for the client)."""
        if self._manager is None:
            return []
        broken = {r.request_id: r.grammar.error for r in self._compiling()
                  if r.grammar.error is not None}
        if not broken:
            return []
        outputs = self.scheduler.abort_requests(broken, RequestStatus.FINISHED_ERROR)
        for out in outputs:
            out.error, out.error_kind = str(broken[out.request_id]), ErrorKind.INVALID_GRAMMAR
        return outputs

    def wait_for_compiling(self) -> None:
        if self._manager is not None:
            states = [r.grammar for r in self._compiling()]
            if states:
                GuidedDecodingManager.wait_any(states, _IDLE_WAIT_S)

    def start_bitmask(self, sched: SchedulerOutput) -> StepBitmask | None:
        """Start filling the bitmask of the constrained requests that sample this step: one row
        each, or 1 + k rows for a request verifying k speculative tokens (row j: the mask after
        its first j proposed tokens)."""
        if self._manager is None:
            return None
        requests = self.scheduler.requests
        entries = []
        for req_id, num in sched.num_scheduled_tokens.items():
            req = requests[req_id]
            if req.grammar is not None and req.num_computed_tokens + num >= req.num_tokens:
                entries.append((req_id, req.grammar,
                                list(sched.scheduled_spec_tokens.get(req_id, ()))))
        return self._manager.start_bitmask(entries) if entries else None

    def fill_stats(self, stats) -> None:
        if self._manager is not None:
            stats.num_grammar_compiles = self._manager.cache.num_compiles
            stats.num_grammar_cache_hits = self._manager.cache.hits

    def stats(self) -> dict:
        return self._manager.stats() if self._manager is not None else {
            "size": 0, "capacity": self.config.guided_cache_size, "hits": 0, "num_compiles": 0,
            "num_mask_steps": 0}
