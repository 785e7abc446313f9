"""Worker: one per rank. Owns the device, the thread settings, KV-cache memory sizing and the
``ModelRunner``; the executor calls it and nothing else does."""

from __future__ import annotations

import contextlib
import gc
import logging
import random

import numpy as np
import torch

from bladellm.config import EngineConfig, parse_size
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.kernels import resolve_kernels
from bladellm.platforms.interface import Platform
from bladellm.platforms.select import resolve_platform
from bladellm.platforms.cpu_defaults import (kv_cache_num_blocks, model_weight_bytes,
                                             total_memory_bytes)
from bladellm.platforms.threads import configure_engine_threads
from bladellm.worker.memory_profile import plan_kv_cache, profile_activations
from bladellm.worker.model_runner import ModelRunner
from bladellm.worker.standalone_forwards import embed_prompts, time_token_forward
from bladellm.worker.step_output import DeferredOutput

logger = logging.getLogger(__name__)


def seed_process_rngs(seed: int | None) -> None:
    """``--seed``: seed this process's global generators (torch's, on every device, Python's and
    NumPy's), from which a request without its own ``seed`` draws (``sample/draw.py``), so that
    its samples repeat from one engine start to the next. None leaves them unseeded. Every rank
    is seeded alike; only the driver samples."""
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed & ((1 << 64) - 1))


def rank_num_blocks(config: EngineConfig, bytes_per_block: int, weight_bytes: int,
                    max_model_len: int, local_world_size: int,
                    device_memory: int | None = None) -> int:
    """KV blocks of ``bytes_per_block`` a rank holding ``weight_bytes`` (everything it loaded:
    weights, their prepacked copies, an sps draft) can hold (``kv_cache_num_blocks``). Ranks on
    one machine share its memory: each sizes its pool from its share; a GPU rank
    (``device_memory``: its GPU's total) has its own. ``blade_llm_check`` sizes the pool with
    this too."""
    cache = config.cache
    kv_bytes = None if cache.kv_cache_memory == "auto" else parse_size(cache.kv_cache_memory)
    total = (total_memory_bytes() // local_world_size if device_memory is None
             else device_memory)
    return kv_cache_num_blocks(cache.num_kv_blocks, kv_bytes, bytes_per_block,
                               config.scheduler.max_num_seqs, max_model_len, cache.block_size,
                               weight_bytes, total)


def check_platform_flags(platform: Platform, config: EngineConfig) -> None:
    """Flags that the resolved platform cannot honour: refused at start-up, never ignored."""
    if not platform.sizes_kv_cache_by_profiling and config.sets_gpu_memory_utilization:
        raise ValueError(f"--max_gpu_memory_utilization: applies to GPU devices, and "
                         f"--device {config.device} runs on {platform.name}; size the KV cache "
                         f"with --kv_cache_memory")
    if config.speculative.enabled and not platform.supports_speculative_decoding:
        raise ValueError(f"--decode_algo {config.speculative.decode_algo}: speculative "
                         f"decoding does not run on {platform.name} yet; use --device cpu "
                         f"(docs/gpu.md)")
    if config.lora.enable_lora and not platform.supports_lora:
        raise ValueError(f"--enable_lora: LoRA adapters do not run on {platform.name} yet; use "
                         f"--device cpu (docs/gpu.md)")


class Worker:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, rank: int = 0,
                 num_threads: int | None = None, local_world_size: int = 1) -> None:
        """``num_threads``: this rank's torch threads (default ``--num_threads``);
        ``local_world_size``: ranks on this machine, which share its memory for KV caches."""
        self.config = config
        self.rank = rank
        self.local_world_size = local_world_size
        # --device, resolved once: every device difference below is asked of the platform.
        self.platform = resolve_platform(config.device)
        check_platform_flags(self.platform, config)
        self.device = self.platform.device(rank % local_world_size)
        self.platform.set_device(self.device)
        seed_process_rngs(config.model.seed)  # before anything draws from them
        configure_engine_threads(num_threads or config.parallel.num_threads)  # logs the choice
        # --kernels, resolved once with the device; everything below is handed this set.
        self.kernels = resolve_kernels(config.model.kernels, self.device,
                                       (config.model.attn_cls, config.draft.attn_cls))
        logger.info("worker %d on %s (--device %s); kernels: %s", rank,
                    self.platform.describe(self.device), config.device,
                    self.kernels.describe())
        self.memory = self.platform.memory_reader(self.device)
        # The GPU's free memory before this engine took any: what other processes hold is not
        # ours to size the KV cache from (worker/memory_profile.py).
        self.memory_at_start = None
        if self.platform.sizes_kv_cache_by_profiling:
            # An engine shut down earlier in this process may still be garbage (cycles) or
            # blocks in torch's cache: neither is another process's, so free both first.
            gc.collect()
            self.memory.release_cached()
            self.memory_at_start = self.memory.snapshot()
        # A vision-language config nests its language model's (a cached snapshot of one has
        # no ``get_text_config``).
        text_config = getattr(resolved.hf_config, "text_config", None) or resolved.hf_config
        self.vocab_size = int(text_config.vocab_size)
        # The driver samples and answers; the other ranks run their part of the forward.
        self.model_runner = ModelRunner(config, resolved, self.device, self.kernels,
                                        is_driver=rank == config.parallel.driver_rank)

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold: ``--num_kv_blocks``, ``--kv_cache_memory SIZE``, or
        auto (a fixed share of total memory minus the weights; deterministic per machine), never
        more than ``--max_num_seqs`` full-length requests can use (+1 for the null block)."""
        runner = self.model_runner
        # sps: one block id holds the target's and the draft's KV, so the budget is shared in
        # proportion to their per-token KV sizes.
        per_block = runner.bytes_per_block + runner.spec_bytes_per_block
        weights = model_weight_bytes(runner.model) + runner.packed_weight_bytes
        if runner.spec_bytes_per_block:
            logger.info("KV budget shared by target and draft: %d + %d bytes per block",
                        runner.bytes_per_block, runner.spec_bytes_per_block)
            weights += model_weight_bytes(runner.spec.proposer.model)
        # Hybrid KV cache groups: a request holds a block id per group for each block of
        # tokens, so the cap on what requests can use counts every group's table.
        max_request_tokens = runner.max_blocks_per_request * self.config.cache.block_size
        cache, sched = self.config.cache, self.config.scheduler
        if not self.platform.sizes_kv_cache_by_profiling:
            return rank_num_blocks(self.config, per_block, weights, max_request_tokens,
                                   self.local_world_size)
        if cache.num_kv_blocks is not None or cache.kv_cache_memory != "auto":
            # An explicit size wins over the profile; it must fit the GPU with the weights.
            return rank_num_blocks(self.config, per_block, weights, max_request_tokens,
                                   self.local_world_size, self.memory.snapshot().total)
        # Every rank profiles the same step (collective_rpc), so TP collectives and pipeline
        # send/recv pair up as in a real step; the pool size is then the ranks' minimum.
        with self._pipeline_call(1):
            profiled = profile_activations(
                runner, self.memory, lambda: self.platform.synchronize(self.device),
                sched.max_num_batched_tokens, sched.max_num_seqs, self.vocab_size,
                self.memory_at_start)
        plan = plan_kv_cache(self.memory_at_start.total, self.memory_at_start.free,
                             cache.max_gpu_memory_utilization, weights,
                             profiled.activation_bytes, per_block, runner.block_size,
                             max_request_tokens, non_torch_bytes=profiled.non_torch_bytes)
        logger.info("worker %d: %s", self.rank, plan.describe())
        return plan.num_blocks

    def spec_forward_times(self) -> tuple[float, float]:
        """sps: seconds of a one-token forward of the (target, draft) on this rank, measured.
        Their ratio is what the cost rule charges per draft forward: on a small model a
        decode step's per-layer overheads weigh as much as its weight bytes, so neither the
        multiply-adds nor the bytes of a quantized draft predict it (a 4-bit copy of the demo
        model reads a third of its bytes and runs at ~0.7 of its time)."""
        runner = self.model_runner
        if not runner.spec_bytes_per_block:
            raise RuntimeError("spec_forward_times: no sps draft model is loaded")
        return (time_token_forward(runner.model, self.device),
                time_token_forward(runner.spec.proposer.model, self.device))

    def shutdown(self) -> None:
        """Let go of the model, the KV cache and the runner's buffers and hand the device
        memory back (torch's cache included), so that another engine in this process can size
        its own from what the device then has free. The worker serves no step after this."""
        runner, self.model_runner = self.model_runner, None
        if runner is None:
            return
        runner.kv_caches = []  # freed now: nothing else holds them
        if runner.spec_bytes_per_block:
            runner.spec.proposer.kv_caches = []
        del runner
        # The model's modules hold reference cycles (weight loaders bound to their layers), so
        # its weights go at the next collection: the next worker's start-up runs one. Not here:
        # a serving process's shutdown must not spend its budget collecting a heap it is about
        # to drop (engine/core_proc.py).
        self.memory.release_cached()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        runner = self.model_runner
        runner.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, --kv_cache_memory "
                    "%s)", num_blocks, runner.block_size, num_blocks * runner.block_size,
                    num_blocks * (runner.bytes_per_block + runner.spec_bytes_per_block)
                    / (1 << 30),
                    self.config.cache.kv_cache_memory)

    def _pipeline_call(self, num_forwards: int) -> contextlib.AbstractContextManager:
        """Pipeline parallelism: keep the stage-to-stage stream in step if this call fails
        (``StageChannel.call``); nothing at pipeline size 1."""
        channel = getattr(getattr(self.model_runner.model, "model", None), "channel", None)
        return channel.call(num_forwards) if channel is not None else contextlib.nullcontext()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        with self._pipeline_call(0 if sched.is_empty else 1):
            return self.model_runner.execute_model(sched)

    def execute_model_async(self, sched: SchedulerOutput) -> DeferredOutput:
        """Launch a step in this process (world size 1: no pipeline channel); ``result()``
        reads its sampled ids (``--async_scheduling`` calls it after launching the next)."""
        return self.model_runner.execute_model_async(sched)

    def set_eos_token_ids(self, eos_token_ids: list[int]) -> None:
        self.model_runner.set_eos_token_ids(eos_token_ids)

    def drop_requests(self, req_ids: list[str]) -> None:
        self.model_runner.drop_requests(req_ids)

    def sync_loras(self, wanted: list) -> tuple[list[int], dict[int, str], bool]:
        """LoRA host tier: (ready ids, failed ids, loads still running); see lora/manager.py."""
        lora = self.model_runner.lora
        if lora is None:
            return [], {r.lora_int_id: "LoRA is not enabled (--enable_lora)" for r in wanted}, False
        ready, failed = lora.sync(wanted)
        return ready, failed, lora.has_pending_loads

    def remove_lora(self, lora_id: int) -> None:
        lora = self.model_runner.lora
        if lora is not None:
            lora.remove(lora_id, self.model_runner.input_batch.active_lora_ids())

    def check_health(self) -> None:
        """Raises if this worker cannot serve (in-process: it is alive if we got here)."""

    def embed(self, prompts: list[list[int]], pooling: str) -> list[list[float]]:
        """Pooled hidden states of each prompt (the embeddings path, apart from the step)."""
        with self._pipeline_call(len(prompts)):
            return embed_prompts(self.model_runner.model, prompts, pooling, self.device)
