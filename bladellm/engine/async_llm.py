"""AsyncLLM: the asyncio front of an engine core running in its own process.

Tokenization, detokenization and stop strings run here, in the API process; the engine core only
sees token ids. Each request gets an ``asyncio.Queue``; one background task reads engine-core
outputs and fans them out. Closing a request's generator (client disconnect, cancellation) aborts
it in the core, which frees its KV blocks. A dead core fails every pending request with
``EngineDeadError`` instead of leaving it hanging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from bladellm.config import EngineConfig
from bladellm.errors import (EngineDeadError, EngineOverloadedError, ErrorKind,
                             RequestFailedError, ServerShuttingDownError, request_error)
from bladellm.engine.core_client import AsyncMPClient
from bladellm.engine import embedding
from bladellm.engine.cpu_offload import CpuOffload
from bladellm.engine.input_processor import InputProcessor
from bladellm.engine.messages import SchedulerStats
from bladellm.engine.metrics import StatLogger
from bladellm.engine.output_processor import OutputProcessor
from bladellm.engine.model_info import model_info_for
from bladellm.lora.request import LoRARequest
from bladellm.checkpoint.hub import download_model, is_model_id
from bladellm.checkpoint.locate import HUB_FLAGS, ResolvedModel, locate_model
from bladellm.checkpoint.pooling_config import pooling_config
from bladellm.outputs import RequestOutput
from bladellm.sampling_params import SamplingParams
from bladellm.platforms.threads import configure_frontend_threads

logger = logging.getLogger(__name__)


def _local_model_config(config: EngineConfig, resolved: ResolvedModel) -> EngineConfig:
    """The engine core gets the resolved local path, so that a hub model id is fetched (or
    looked up) once, here, not again in the core process."""
    path = resolved.source or resolved.path
    if config.model.model in ("demo", path):
        return config
    draft = config.draft
    if draft.model is not None and draft.model != "demo" and is_model_id(draft.model):
        # The sps draft comes from the same hub (--model_hub, --download_dir): fetched here
        # too, as the flags do not reach the core.
        draft = dataclasses.replace(draft, model=download_model(
            draft.model, None, config.model.download_dir, config.model.model_hub))
    # The hub flags were spent on the fetch: on a local path they would be refused.
    return dataclasses.replace(config, draft=draft, model=dataclasses.replace(
        config.model, model=path, **HUB_FLAGS))


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 client: AsyncMPClient | None = None) -> None:
        """``client``: an engine core already started for ``config`` (``AsyncMPClient(config,
        wait=False)``), so that its start-up overlapped the caller's; None starts one here."""
        configure_frontend_threads()
        self.config = config
        self.client = client
        try:
            # Located, not resolved: the engine core checks the quantization config and
            # --dtype (they need torch, which this process never imports).
            resolved = locate_model(config.model, snapshot_config=True)
            if self.client is None:  # the engine core loads weights while we load the tokenizer
                self.client = AsyncMPClient(_local_model_config(config, resolved), wait=False)
            self.model_info = model_info_for(resolved)
            self.input_processor = InputProcessor(
                self.model_info, config.guided.guided_max_grammar_size,
                priority_scheduling=config.scheduler.priority_scheduling,
                mm_config=config.multimodal)
            self.lora_registry = None  # names/paths -> adapters (bladellm/lora/registry.py)
            if config.lora.enable_lora:
                from bladellm.lora.registry import LoRARegistry

                self.lora_registry = LoRARegistry(config.lora, resolved.hf_config)
            self.client.wait_ready(self.model_info.eos_token_ids)
        except BaseException:
            if self.client is not None:
                self.client.close()
            raise
        self.output_processor = OutputProcessor(self.model_info.tokenizer)
        self.pooling = pooling_config(resolved.path, resolved.hf_config)
        # Tokenization runs here, not on the event loop (the server shares this thread).
        self.cpu_offload = CpuOffload()
        # Constraint validation (seconds for a huge guided_choice) in its own two threads:
        # in the tokenizer's single queue it held up every request behind it.
        self.grammar_offload = CpuOffload("bladellm-grammar-check", max_workers=2)
        self.stat_loggers = list(stat_loggers or [])
        self._queues: dict[str, asyncio.Queue] = {}
        self._not_started: set[str] = set()  # requests without a first output yet
        self._output_task: asyncio.Task | None = None
        # Until the first step reports, the pool's size is already known (/metrics shows the
        # total KV blocks from the start); the pool keeps block 0 as its null block.
        self._latest_stats: SchedulerStats | None = SchedulerStats(
            num_total_blocks=max(int(getattr(self.client, "num_blocks", 0) or 0) - 1, 0))
        self._utility_waiters: dict[int, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._failed_all: str | None = None  # set by fail_all: no new request gets in

    @classmethod
    def from_engine_config(cls, config: EngineConfig,
                           stat_loggers: list[StatLogger] | None = None,
                           client: AsyncMPClient | None = None) -> "AsyncLLM":
        return cls(config, stat_loggers, client)

    # ---- status -------------------------------------------------------------------------------
    @property
    def is_dead(self) -> bool:
        return self.client.is_dead or not self.client.proc.is_alive()

    @property
    def dead_reason(self) -> str | None:
        if self.is_dead and self.client.dead_reason is None:
            self.client.dead_reason = f"engine core exited (code {self.client.proc.exitcode})"
        return self.client.dead_reason

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)

    def get_scheduler_stats(self) -> SchedulerStats | None:
        if self.is_dead:  # a dead core holds nothing: never report its last snapshot
            return None
        return self._latest_stats

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def fail_all(self, reason: str) -> int:
        """Finish every in-flight request with ``ServerShuttingDownError`` (their generators
        abort them in the core); returns how many there were."""
        self._failed_all = reason
        for queue in self._queues.values():
            queue.put_nowait(ServerShuttingDownError(reason))
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str, *, delta: bool = True,
                       lora_request: LoRARequest | None = None,
                       priority: int = 0,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Raises before yielding for bad input or overload.
        ``priority``: lower runs first under ``--scheduling_policy priority`` (refused other
        than 0 under fcfs)."""
        await self.check_health()
        self._ensure_output_task()
        if request_id in self._queues or request_id in self._not_started:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        limit = self.config.scheduler.max_queue_size
        if limit is not None and len(self._not_started) >= limit:
            raise EngineOverloadedError(f"{len(self._not_started)} requests waiting "
                                        f"(--max_queue_size {limit})")
        arrival = time.time()
        # Counted as waiting from here: requests being tokenized take their queue slot at once.
        self._not_started.add(request_id)
        try:
            core_reqs = await self.cpu_offload.run(
                self.input_processor.process, request_id, prompt, sampling_params, arrival,
                lora_request=lora_request, validate_grammar=False, priority=priority,
                images=images)
            if sampling_params.guided_decoding is not None:
                # Not in the tokenizer's queue; a client gone before its turn never starts it.
                await self.grammar_offload.run(self.input_processor.validate_grammar,
                                               sampling_params)
        except BaseException:
            self._not_started.discard(request_id)
            raise
        if self._failed_all is not None:  # shutting down while this one was being tokenized
            self._not_started.discard(request_id)
            raise ServerShuttingDownError(self._failed_all)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None,
            core_reqs[0].prompt_token_ids, sampling_params, [r.request_id for r in core_reqs],
            arrival, delta=delta)
        finished = yielded = False
        try:
            await self.client.add_requests(core_reqs)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # A failure before any output is an error response; after, a finish_reason.
                if item.error is not None and (
                        not yielded or item.error_kind is ErrorKind.QUEUE_TIMEOUT):
                    raise request_error(item.error_kind, item.error)  # `finally` aborts siblings
                finished, yielded = item.finished, True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._not_started.discard(request_id)
            if not finished:
                # No await here: this runs while the request is being cancelled (client gone),
                # and a second cancellation must not skip the abort that frees the KV blocks.
                self._abort_nowait(request_id)

    async def embed(self, prompts: list[str | list[int]], dimensions: int | None = None,
                    truncate_prompt_tokens: int | None = None) -> list[embedding.EmbeddingOutput]:
        """Embeddings of the prompts (pooled as the model's config says, normalized);
        ``truncate_prompt_tokens`` as vLLM's (``embedding.truncate_prompt``)."""
        await self.check_health()
        embedding.check_dimensions(dimensions, self.pooling)
        info = self.model_info
        embedding.truncate_prompt([], truncate_prompt_tokens, info.max_model_len)  # validate

        def tokenize() -> list[list[int]]:
            ids = [embedding.truncate_prompt(self.input_processor.tokenize(p),
                                             truncate_prompt_tokens, info.max_model_len)
                   for p in prompts]
            for i, one in enumerate(ids):
                embedding.check_prompt(one, info.max_model_len, info.vocab_size, i)
            return ids

        ids = await self.cpu_offload.run(tokenize)
        vectors = await self._core_call("embed", ids, self.pooling.pooling)
        return [embedding.EmbeddingOutput(embedding.finish(v, self.pooling, dimensions), p)
                for v, p in zip(vectors, ids)]

    async def _core_call(self, method: str, *args) -> list:
        reply = await self.call_utility(method, *args)
        if "error" in reply:  # type: ignore[operator]
            raise RequestFailedError(reply["error"])  # type: ignore[index]
        return reply["result"]  # type: ignore[index]

    async def abort(self, request_id: str) -> None:
        self._abort_nowait(request_id)

    def _abort_nowait(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_request(request_id)
        self._queues.pop(request_id, None)
        self._not_started.discard(request_id)
        if child_ids:
            self._send_in_background(self.client.abort_requests(child_ids))

    def _send_in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def call_utility(self, method: str, *args) -> object:
        """Run a debug/maintenance call in the engine core (e.g. 'check_invariants')."""
        self._ensure_output_task()
        call_id = await self.client.call_utility(method, *args)
        fut = asyncio.get_running_loop().create_future()
        self._utility_waiters[call_id] = fut
        return await fut

    async def remove_lora(self, name: str) -> None:
        """Unregister an adapter and drop its copies in the engine (running requests finish)."""
        if self.lora_registry is None:
            raise ValueError("LoRA is not enabled (--enable_lora)")
        req = self.lora_registry.remove(name)
        await self.call_utility("remove_lora", req.lora_int_id)

    # ---- output loop --------------------------------------------------------------------------
    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                if outputs.engine_dead is not None:
                    raise EngineDeadError(outputs.engine_dead)
                if outputs.utility_result is not None:
                    call_id, result = outputs.utility_result
                    fut = self._utility_waiters.pop(call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(result)
                    continue
                self._dispatch(outputs)
        except EngineDeadError as exc:
            logger.error("engine core is dead: %s", exc)
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(str(exc)))
            for fut in self._utility_waiters.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError(str(exc)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a front-end bug must not hang clients
            logger.exception("output loop failed")
            for queue in self._queues.values():
                queue.put_nowait(RequestFailedError(f"output processing failed: {exc}"))

    def _dispatch(self, outputs) -> None:
        if outputs.scheduler_stats is not None:
            self._latest_stats = outputs.scheduler_stats
        start = time.perf_counter()
        processed = self.output_processor.process_outputs(outputs.outputs, time.time())
        for request_id, out in processed.request_outputs.items():
            self._not_started.discard(request_id)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(out)
        processed.iteration.output_processing_seconds = time.perf_counter() - start
        if processed.reqs_to_abort:
            self._send_in_background(self.client.abort_requests(processed.reqs_to_abort))
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs.scheduler_stats, processed.iteration, processed.finished)

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("engine is shutting down"))
        self.client.close()
        self.cpu_offload.shutdown()
        self.grammar_offload.shutdown()
