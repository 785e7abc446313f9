"""The engine core: schedule → execute → update, in-process or in its own process.

``EngineCore`` is the step loop's body, used directly by the offline ``LLM`` and tests.
``run_engine_core_proc`` wraps it in a busy loop behind two ZMQ sockets for ``AsyncLLM``.
"""

from __future__ import annotations

import logging
import time
import traceback

from bladellm.config import EngineConfig
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.core.scheduler import Scheduler
from bladellm.executor import get_executor_class
from bladellm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from bladellm.model.checkpoint import ResolvedModel
from bladellm.request import Request

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.config = config
        self.max_model_len = resolved.max_model_len
        self.executor = get_executor_class(config)(config, resolved)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len)
        self.num_blocks = num_blocks

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_ids=tuple(req.eos_token_ids), max_model_len=self.max_model_len,
            arrival_time=req.arrival_time or None, cache_salt=req.cache_salt))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def embed(self, prompts: list[list[int]], pooling: str) -> list[list[float]]:
        """Embeddings of token-id prompts, outside the scheduler (they hold no KV blocks)."""
        return self.executor.collective_rpc("embed", (prompts, pooling))[0]

    def prompt_logprobs(self, prompts: list[list[int]], num_top: int) -> list[list]:
        """Prompt-token logprobs, outside the scheduler (a separate forward per prompt)."""
        return self.executor.collective_rpc("prompt_logprobs", (prompts, num_top))[0]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        runner_out = self._execute(sched)
        outputs = self.scheduler.update_from_output(sched, runner_out)
        if self.config.debug_block_accounting:
            self.scheduler.check_invariants()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.get_stats(),
                                 timestamp=time.time())

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the batch; if it fails, fail the requests in it rather than the engine."""
        try:
            return self.executor.execute_model(sched)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not kill the server
            logger.error("step failed; failing its %d requests:\n%s",
                         len(sched.num_scheduled_tokens), traceback.format_exc())
            req_ids = list(sched.num_scheduled_tokens)
            # The workers must forget them too (their blocks are freed by the scheduler).
            self.executor.drop_requests(req_ids)
            return ModelRunnerOutput(
                req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids],
                errored={r: f"{type(exc).__name__}: {exc}" for r in req_ids})
