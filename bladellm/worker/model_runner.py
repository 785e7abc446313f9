"""ModelRunner: apply the scheduler's diffs to the persistent batch, run the model on the flat
batch, sample.

One per rank, owned by a ``Worker``. Holds the model, the paged KV cache (one tensor per layer;
with hybrid KV cache groups one per slot, shared by a layer of each group, core/kv_groups.py)
and the ``InputBatch``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial

import torch

from bladellm.attention import get_attn_backend
from bladellm.attention.kv_cache import allocate_kv_caches, kv_bytes_per_block
from bladellm.config import EngineConfig
from bladellm.checkpoint.attention_layout import layer_windows
from bladellm.checkpoint.locate import ResolvedModel
from bladellm.core.kv_groups import KVCacheGroups, engine_kv_cache_groups
from bladellm.distributed.parallel_state import get_pp_group
from bladellm.distributed.partition import pipeline_stages
from bladellm.core.interface import ModelRunnerOutput, SchedulerOutput
from bladellm.core.outputs import Logprobs
from bladellm.kernels.interface import Kernels
from bladellm.kernels.scope import building_with
from bladellm.model.decoder_stack import attach_compiled_stack
from bladellm.model.forward_context import ForwardContext
from bladellm.model.layers.embedding import ParallelLMHead
from bladellm.model.layers.fused_moe import moe_layers
from bladellm.model.layers.linear import UnquantizedLinearMethod
from bladellm.model.loader import load_resolved_model
from bladellm.platforms.cpu_defaults import model_weight_bytes, total_memory_bytes
from bladellm.platforms.select import platform_of
from bladellm.sample.logprobs import prompt_logprobs
from bladellm.sample.sampler import Sampler, SamplerOutput
from bladellm.worker.device_inputs import DeviceStager
from bladellm.worker.cuda_graphs import StaticStepBuffers, make_step_graphs
from bladellm.worker.encoder_cache import EncoderCache
from bladellm.worker.input_batch import InputBatch, StepInputs
from bladellm.worker.mrope_positions import MRopePositions
from bladellm.worker.sampling_rows import attach_grammar_bitmask
from bladellm.worker.step_output import DeferredOutput

logger = logging.getLogger(__name__)


def packable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The unquantized linear layers, then the LM heads, of ``model``: the modules that may keep
    their kernels' load-time weight forms (quantized layers were unpacked into their kernels'
    layout by the loader already)."""
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)]
    return layers + [m for m in model.modules() if isinstance(m, ParallelLMHead)]


def prepack_bound(weights: Iterable[torch.Tensor], weight_bytes: int,
                  kernels: Kernels) -> tuple[int, bool]:
    """(the most ``kernels``' load-time forms of ``weights`` can take, whether they are made):
    made only while that bound (``packed_bytes_bound``: 1x the fp32 weights on AVX2, 1.5x
    elsewhere, 1x for bf16) is at most a quarter of the memory a model of ``weight_bytes``
    leaves. ``blade_llm_check`` counts the copies with this too, so the two cannot drift."""
    extra = sum(kernels.packed_bytes_bound(w) for w in weights)
    return extra, extra <= (total_memory_bytes() - weight_bytes) // 4


def _check_vision_language_flags(model: torch.nn.Module, config: EngineConfig) -> None:
    """Features not built for vision-language models yet are refused, not half-applied."""
    if not hasattr(model, "encode_image"):
        return
    if config.lora.enable_lora:
        raise ValueError("--enable_lora: LoRA adapters are not supported with "
                         "vision-language models yet")
    if config.speculative.decode_algo != "normal":
        raise ValueError(f"--decode_algo {config.speculative.decode_algo}: speculative "
                         f"decoding is not supported with vision-language models yet")


class ModelRunner:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel,
                 device: torch.device, kernels: Kernels, is_driver: bool = True) -> None:
        """``kernels``: the set the worker resolved from ``--kernels`` for ``device``; the
        model's layers, attention, sampler and compiled stack all run on it."""
        self.config = config
        self.device = device
        self.kernels = kernels
        # Only the driver (TP rank 0 of the last pipeline stage) samples; the other TP ranks run
        # the same forward and logits (their collectives need every rank), earlier stages their
        # layers; all learn the sampled tokens from the next step's scheduler diffs.
        self.is_driver = is_driver
        self.block_size = config.cache.block_size
        self.max_model_len = resolved.max_model_len
        self.dtype = resolved.dtype
        self.attn_backend = get_attn_backend(config.model.attn_cls, kernels)
        start = time.perf_counter()
        with building_with(kernels):
            self.model = load_resolved_model(resolved, device, self.attn_backend)
        self.model.eval()
        self.packed_weight_bytes = self._prepack_weights()
        logger.info("loaded %s (%s) in %.1f s; attention: %s", resolved.architecture,
                    self.dtype, time.perf_counter() - start, self.attn_backend.name)
        self.sampler = Sampler(kernels)
        # Each step's host-built inputs go to the device in one pass (pinned where possible).
        platform = platform_of(device)
        self.stager = DeviceStager(device, platform.supports_pinned_memory,
                                   platform.copy_fence(device))
        sched = config.scheduler
        self.kv_cache_groups = engine_kv_cache_groups(
            layer_windows(resolved.hf_config), config.cache.disable_hybrid_kv_cache,
            config.speculative.decode_algo)
        self.input_batch = InputBatch(sched.max_num_seqs, self.max_model_len,
                                      sched.max_num_batched_tokens, self.block_size,
                                      self.kv_cache_groups.num_groups)
        self.kv_caches: list[torch.Tensor] = []
        spec = self.model.get_kv_cache_spec()  # per rank: stays right under TP
        self.num_layers, self.num_kv_heads, self.head_dim = (
            spec.num_layers, spec.num_kv_heads, spec.head_dim)
        # Each of this stage's layers: (KV cache group, slot).
        self.layer_placement = self._layer_placement(self.kv_cache_groups)
        self.num_kv_slots = len({slot for _, slot in self.layer_placement})
        _check_vision_language_flags(self.model, config)
        self.spec = self._make_spec_decoder(resolved)
        # A vision-language model: image features by content hash (worker/encoder_cache.py).
        self.encoder_cache = (EncoderCache(device) if hasattr(self.model, "encode_image")
                              else None)
        # M-RoPE (Qwen2-VL): positions [3, T] per step (worker/mrope_positions.py); else [T].
        self.mrope = (MRopePositions(self.model.mrope_positions)
                      if hasattr(self.model, "mrope_positions") else None)
        self.lora = None  # LoRAManager: adapter tiers and the layers' device slots
        if config.lora.enable_lora:
            from bladellm.lora.manager import LoRAManager

            self.lora = LoRAManager(config.lora, self.model, resolved.hf_config, self.dtype)
        if not config.model.enforce_eager:
            # After prepacking and LoRA wrapping, which decide what the compiled stack may read.
            attach_compiled_stack(self.model, kernels)
        # CUDA graphs of decode / fixed-length verification steps (worker/cuda_graphs.py),
        # captured after the KV cache exists.
        self.graphs = make_step_graphs(config, device, self.model, self._graph_buffers)

    @property
    def _graph_buffers(self):
        """Makes the graphs' static buffers (max requests, max tokens); holds no reference to
        the runner, so that dropping it frees the KV cache at once."""
        return partial(StaticStepBuffers, table_width=self.input_batch.max_blocks_per_req,
                       num_extra_groups=self.kv_cache_groups.num_groups - 1,
                       block_size=self.block_size, max_model_len=self.max_model_len,
                       device=self.device)

    def use_padded_eager_steps(self, sizes: list[int] | None = None) -> None:
        """Internal (tests): run graphable steps padded through the graphs' static buffers,
        eagerly, on any device; ``sizes`` overrides the batch sizes. The CPU check of the
        padding a CUDA graph replays."""
        graphs = make_step_graphs(self.config, self.device, self.model, self._graph_buffers,
                                  eager_padding=True)
        if sizes is not None:
            graphs.sizes = sorted(sizes)
        self.graphs = graphs

    def _make_spec_decoder(self, resolved: ResolvedModel):
        """--decode_algo sps / look_ahead: the proposer and the verification step."""
        algo = self.config.speculative.decode_algo
        if algo == "normal":
            return None
        from bladellm.worker.spec_step import SpecDecoder

        if algo == "sps":
            from bladellm.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(self.config, resolved, self.device, self.block_size,
                                          self.kernels)
        else:
            from bladellm.spec_decode.lookahead import LookaheadProposer

            proposer = LookaheadProposer(self.config.speculative, self.block_size)
        return SpecDecoder(proposer, self.input_batch, self.sampler)

    @property
    def spec_bytes_per_block(self) -> int:
        """KV bytes per block of the sps draft model (0 without one): blocks hold both."""
        return getattr(getattr(self.spec, "proposer", None), "bytes_per_block", 0)

    def _prepack_weights(self) -> int:
        """Let each linear layer and the LM head keep its kernels' load-time weight forms (on
        CPU: a oneDNN reordered copy that runs batched GEMMs faster, and for fp32
        weights that are exact bf16 values a bf16 copy that halves what a decode step streams;
        on AVX2 only that weight or its bf16 copy packed in panels, for every batch;
        ``CompiledKernels.pack_linear_weight``), when ``prepack_bound`` says they are made.
        Returns the bytes they added."""
        packable = packable_modules(self.model)
        experts = moe_layers(self.model)  # mixture of experts: each expert packed as a linear
        expert_weights = [w[e] for m in experts for w in (m.gate_up_proj, m.down_proj)
                          for e in range(w.shape[0])]
        extra, made = prepack_bound([m.weight for m in packable] + expert_weights,
                                    model_weight_bytes(self.model), self.kernels)
        if not packable or not made:
            if packable:
                logger.info("linear weights not prepacked: the copies (%.0f MiB) would exceed "
                            "a quarter of the spare memory", extra / (1 << 20))
            return 0
        kernels = self.kernels
        layers = [m for m in packable if not isinstance(m, ParallelLMHead)]
        heads = [m for m in packable if isinstance(m, ParallelLMHead)]
        for m in layers:
            m.quant_method.process_weights_after_loading(m)
        for h in heads:
            h.process_weights_after_loading()
        for m in experts:
            m.process_weights_after_loading()
        packs = [getattr(m, "packed_weight", None) for m in packable]
        added = sum(kernels.packed_bytes(p) for p in packs + [m.packed for m in experts])
        narrow = sum(getattr(p, "bf16_copy", None) is not None for p in packs)
        logger.info("prepacked %d of %d linear weights (+%.0f MiB)%s",
                    sum(p is not None for p in packs), len(packable), added / (1 << 20),
                    f"; {narrow} fp32 weights hold only bf16 values: small batches read their "
                    f"bf16 copy (half the bytes, same results)" if narrow else "")
        return added

    # ---- KV cache -------------------------------------------------------------------------------
    def _layer_placement(self, groups: KVCacheGroups) -> list[tuple[int, int]]:
        """(group, slot) of each layer of this pipeline stage. One group: slot = layer."""
        if groups.num_groups == 1:
            return [(0, layer) for layer in range(self.num_layers)]
        pp = get_pp_group()
        num_total = sum(len(g.layers) for g in groups.groups)
        start, end = pipeline_stages(num_total, pp.world_size)[pp.rank_in_group]
        if end - start != self.num_layers:
            raise ValueError(f"KV cache groups: stage {pp.rank_in_group} runs "
                             f"{self.num_layers} layers, expected {end - start}; run with "
                             f"--disable_hybrid_kv_cache")
        placement = groups.placement()
        return [placement[layer] for layer in range(start, end)]

    @property
    def bytes_per_block(self) -> int:
        """One block id: a block of every slot this stage uses (one per layer without
        hybrid groups)."""
        return kv_bytes_per_block(self.num_kv_slots, self.block_size, self.num_kv_heads,
                                  self.head_dim, self.dtype, self.config.cache.kv_cache_quant)

    @property
    def max_blocks_per_request(self) -> int:
        """Block ids a full-length request can hold (every group's table)."""
        return self.kv_cache_groups.num_groups * -(-self.max_model_len // self.block_size)

    def initialize_kv_cache(self, num_blocks: int, capture_graphs: bool = True) -> None:
        """``capture_graphs`` False: a scratch cache (memory profiling), no graph kept on it."""
        slots = sorted({slot for _, slot in self.layer_placement})
        tensors = dict(zip(slots, allocate_kv_caches(
            len(slots), num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            self.dtype, self.device, self.config.cache.kv_cache_quant)))
        self.kv_caches = [tensors[slot] for _, slot in self.layer_placement]
        if self.spec_bytes_per_block:
            self.spec.proposer.initialize_kv_cache(num_blocks)
        if capture_graphs and self.graphs is not None and self.graphs.capture_enabled:
            self.graphs.capture(self._forward, self.kv_caches,
                                self.config.scheduler.max_num_batched_tokens)

    def set_eos_token_ids(self, eos_token_ids: list[int]) -> None:
        """The model's EOS ids, once at start-up (``EngineCore.set_eos_token_ids``): banned
        below ``min_tokens`` unless a request ignores EOS."""
        self.input_batch.sampling.eos_token_ids = list(eos_token_ids)

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forget requests without a scheduler diff (their step failed)."""
        for req_id in req_ids:
            self.input_batch.remove(req_id)
        if self.encoder_cache is not None:
            self.encoder_cache.remove_requests(req_ids)
        if self.mrope is not None:
            self.mrope.remove_requests(req_ids)
        if self.spec is not None:
            self.spec.drop(req_ids)

    # ---- one step -------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> DeferredOutput:
        """Launch the step; its ``result()`` reads the sampled ids to the host."""
        start = time.perf_counter()
        if self.encoder_cache is not None:
            self.encoder_cache.remove_requests(sched.finished_req_ids | sched.preempted_req_ids)
            for new in sched.scheduled_new_reqs:
                self.encoder_cache.add_request(new.req_id, new.mm_items)
        if self.mrope is not None:
            self.mrope.remove_requests(sched.finished_req_ids | sched.preempted_req_ids)
            for new in sched.scheduled_new_reqs:
                self.mrope.add_request(new)
        self.input_batch.apply(sched)
        if self.spec is not None:
            self.spec.drop(sched.finished_req_ids | sched.preempted_req_ids)
        if sched.is_empty:
            return DeferredOutput.ready(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        if self.spec is not None:
            self.spec.write_proposals(sched)
        inputs = self.input_batch.prepare(sched)
        if self.mrope is not None:
            inputs.positions = self.mrope.positions(inputs)
        if self.spec is not None:
            self.spec.lay_out(sched, inputs)
        inputs = self.stager.stage(inputs)
        self.input_batch.fill_pending(inputs)  # --async_scheduling: tokens still on the device
        phases: dict[str, float] = {}  # core/step_phases.py
        now = time.perf_counter()
        phases["prepare"], start = now - start, now
        key = self.graphs.key_of(inputs) if self.graphs is not None else None
        hidden = (self._forward(inputs) if key is None
                  else self.graphs.run(key, inputs, self._forward, self.kv_caches))
        now = time.perf_counter()
        phases["forward"], start = now - start, now
        if hidden is None:  # a pipeline stage before the last: it sent its activations on
            return DeferredOutput.ready(ModelRunnerOutput(
                req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids],
                phase_seconds=phases))
        # Every TP rank computes them (the LM head's collectives need each); the driver's count.
        prompt_lps = (self._prompt_logprobs(hidden, inputs)
                      if self.input_batch.sampling.num_prompt_logprobs_rows else {})
        if self.spec is not None:  # the verification's LM head and sampling count as "sample"
            out = self.spec.verify(self.model, hidden, sched, inputs)
            out.prompt_logprobs = prompt_lps
            phases["sample"] = time.perf_counter() - start
            out.phase_seconds = phases
            return DeferredOutput.ready(out)
        out = None
        if inputs.sampling is not None:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            now = time.perf_counter()
            phases["logits"], start = now - start, now
            if not self.is_driver:
                return DeferredOutput.ready(ModelRunnerOutput(
                    req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids]))
            if sched.grammar_bitmask is not None:
                attach_grammar_bitmask(inputs, sched.grammar_bitmask)
            out = self.sampler(logits, inputs.sampling, inplace=True)  # logits unused below
            if self.config.scheduler.async_scheduling:  # kept for the next step's pending rows
                self.input_batch.record_sampled(inputs, out.sampled_token_ids)
        # Read now: by ``result()`` the next step may have changed the batch's rows.
        num_logprobs = (None if out is None or out.logprobs is None else
                        [self.input_batch.sampling.params[row].logprobs
                         for row in inputs.sample_rows.tolist()])
        phases["sample"] = time.perf_counter() - start
        return DeferredOutput(
            lambda: self._host_output(inputs, out, prompt_lps, num_logprobs, phases))

    def _host_output(self, inputs: StepInputs, out: SamplerOutput | None,
                     prompt_lps: dict[str, Logprobs],
                     num_logprobs: list[int | None] | None,
                     phases: dict[str, float]) -> ModelRunnerOutput:
        """The step's sampled ids and logprobs, read to the host (waits for the device);
        the wait and the read count in ``phases["sample"]``."""
        start = time.perf_counter()
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, Logprobs] = {}
        if out is not None:
            for i, token in zip(inputs.sample_indices.tolist(), out.sampled_token_ids.tolist()):
                sampled[i] = [token]
            if num_logprobs is not None:
                logprobs = self._logprobs(inputs, out, num_logprobs)
        phases["sample"] += time.perf_counter() - start
        return ModelRunnerOutput(req_ids=inputs.req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs, prompt_logprobs=prompt_lps,
                                 phase_seconds=phases)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model on the step's (or a padded step's) flat inputs: hidden states, or None on
        a pipeline stage before the last."""
        ctx = ForwardContext(attn_metadata=inputs.attn_metadata, kv_caches=self.kv_caches,
                             layer_attn_metadata=self._layer_attn_metadata(inputs))
        if self.lora is not None:
            ctx.lora = self.lora.prepare_step(inputs.token_lora_ids,
                                              self.input_batch.active_lora_ids())
        embeds = self._image_embeds(inputs) if self.encoder_cache is not None else None
        return (self.model(inputs.input_ids, inputs.positions, ctx) if embeds is None
                else self.model(inputs.input_ids, inputs.positions, ctx, embeds))

    def _layer_attn_metadata(self, inputs: StepInputs) -> list | None:
        """Hybrid KV cache groups: each layer's metadata, its group's block tables and slot
        mapping on the step's metadata (after spec lay-out, which may add a tree)."""
        if inputs.group_tables is None:
            return None
        md = inputs.attn_metadata
        by_group = [md] + [replace(md, block_tables=tables, slot_mapping=slots)
                           for tables, slots in inputs.group_tables]
        return [by_group[group] for group, _ in self.layer_placement]

    def _image_embeds(self, inputs: StepInputs) -> torch.Tensor | None:
        """Input embeddings with image features where this step's chunks cover image tokens
        (None: no image token this step)."""
        meta = inputs.attn_metadata
        qsl = meta.query_start_loc_cpu
        first_positions = meta.seq_lens_cpu - (qsl[1:] - qsl[:-1])
        return self.encoder_cache.input_embeds(self.model, inputs.input_ids, inputs.req_ids,
                                               qsl, first_positions)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, Logprobs]:
        """Prompt logprobs from this step's own prefill chunks: for each request that wants
        them, the prompt tokens after the chunk's positions (position p predicts token p + 1),
        so a prompt's chunks together give every token after the first. (Such requests take no
        prompt-cache hit, ``KVCacheManager.get_computed_blocks``: every position runs here.)"""
        ib = self.input_batch
        qsl = inputs.attn_metadata.query_start_loc_cpu
        result: dict[str, Logprobs] = {}
        for i, req_id in enumerate(inputs.req_ids):
            row = ib.row_of[req_id]
            num_top = int(ib.sampling.prompt_logprobs[row])
            start = int(ib.num_computed_tokens[row])
            end = min(start + int(qsl[i + 1] - qsl[i]), int(ib.num_prompt_tokens[row]) - 1)
            if num_top < 0 or end <= start:
                continue
            targets = torch.from_numpy(ib.token_ids[row, start + 1:end + 1].copy())
            first = int(qsl[i])
            result[req_id] = prompt_logprobs(self.model.compute_logits,
                                             hidden[first:first + end - start],
                                             targets.to(hidden.device), num_top)
            if end == int(ib.num_prompt_tokens[row]) - 1:
                # The prompt is done: later steps need not look at this row (a recompute after
                # preemption re-adds it with its params).
                ib.sampling.stop_prompt_logprobs(row)
        return result

    def _logprobs(self, inputs: StepInputs, out: SamplerOutput,
                  num_logprobs: list[int | None]) -> dict[str, Logprobs]:
        """Each request's own share (1 + its ``logprobs``, ``num_logprobs`` by sampled row)
        of the step's widest top-k."""
        ids, lps = out.logprobs_token_ids.tolist(), out.logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        result: dict[str, Logprobs] = {}
        for s, (i, num) in enumerate(zip(inputs.sample_indices.tolist(), num_logprobs)):
            req_id = inputs.req_ids[i]
            if num is not None:
                k = 1 + num
                result[req_id] = Logprobs([ids[s][:k]], [lps[s][:k]], [ranks[s]])
        return result
