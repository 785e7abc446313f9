"""ModelRunner: apply the scheduler's diffs, run the model on the flat batch, sample.

One instance per rank (world size 1 lives inside the engine-core process). Holds the model, the
paged KV cache (one tensor per layer) and the persistent per-request state.
"""

from __future__ import annotations

import logging
import time

import torch

from bladellm.attention import get_attn_backend
from bladellm.attention.backend import AttentionContext
from bladellm.config import EngineConfig, default_kv_cache_bytes, parse_size
from bladellm.core.interface import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from bladellm.model.checkpoint import ResolvedModel
from bladellm.sample.metadata import SamplingMetadata
from bladellm.sample.sampler import Sampler
from bladellm.worker.input_batch import RequestStates, StepInputs, build_step_inputs

logger = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: decorrelates (seed, step) pairs


def step_generator(seed: int, num_output_tokens: int) -> torch.Generator:
    """A generator that depends only on the request's seed and how many tokens it has made.

    Sampling then does not depend on what else is in the batch, nor on preemption/recompute.
    """
    gen = torch.Generator()
    gen.manual_seed((seed * _SEED_MIX + num_output_tokens) & ((1 << 63) - 1))
    return gen


class ModelRunner:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.hf_config = resolved.hf_config
        self.max_model_len = resolved.max_model_len
        self.dtype = resolved.dtype
        self.attn_backend = get_attn_backend(config.model.attn_cls, self.device)
        start = time.perf_counter()
        self.model = resolved.load_model(self.device, self.attn_backend)
        self.model.eval()
        logger.info("loaded %s (%s) in %.1f s", resolved.architecture, self.dtype,
                    time.perf_counter() - start)
        self.sampler = Sampler()
        self.states = RequestStates()
        self.kv_caches: list[torch.Tensor] = []

        spec = self.model.get_kv_cache_spec()  # per rank: stays right under TP
        self.num_layers, self.num_kv_heads, self.head_dim = (
            spec.num_layers, spec.num_kv_heads, spec.head_dim)

    # ---- KV cache -----------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory != "auto":
            return max(2, parse_size(cache.kv_cache_memory) // self.bytes_per_block)
        # auto: a share of free memory, but never more than max_num_seqs full-length requests
        # can use (+1 for the null block): zero-filling unused GiBs only slows start-up.
        usable = self.config.scheduler.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(2, min(default_kv_cache_bytes() // self.bytes_per_block, usable + 1))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block / (1 << 30))

    def drop_requests(self, req_ids: list[str]) -> None:
        """Forget requests without a scheduler diff (their step failed)."""
        for req_id in req_ids:
            self.states.states.pop(req_id, None)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(sched)
        if sched.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = build_step_inputs(sched, self.states, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions,
                            AttentionContext(inputs.metadata, self.kv_caches))
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, SampleLogprobs] = {}
        if inputs.sample_req_ids:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            sampled, logprobs = self._sample(inputs, logits)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in inputs.req_ids],
            logprobs=logprobs)

    def _sample(self, inputs: StepInputs, logits: torch.Tensor
                ) -> tuple[dict[str, list[int]], dict[str, SampleLogprobs]]:
        states = [self.states.states[r] for r in inputs.sample_req_ids]
        params = [s.sampling_params for s in states]
        generators = {i: step_generator(p.seed, s.num_output_tokens)
                      for i, (s, p) in enumerate(zip(states, params)) if p.seed is not None}
        # Token lists are copied per step only for rows whose penalties read them.
        rep = [p.repetition_penalty != 1.0 for p in params]
        out_pen = [r or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                   for r, p in zip(rep, params)]
        metadata = SamplingMetadata.from_params(
            params,
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] if r else []
                              for s, r in zip(states, rep)],
            output_token_ids=[s.output_token_ids if o else [] for s, o in zip(states, out_pen)],
            eos_token_ids=[s.eos_token_ids for s in states],
            generators=generators, device=self.device)
        out = self.sampler(logits, metadata)
        token_ids = out.sampled_token_ids.tolist()
        sampled = {r: [t] for r, t in zip(inputs.sample_req_ids, token_ids)}
        logprobs: dict[str, SampleLogprobs] = {}
        if out.logprobs is not None:
            ids = out.logprobs_token_ids.tolist()
            lps = out.logprobs.tolist()
            ranks = out.sampled_ranks.tolist()
            for i, (req_id, p) in enumerate(zip(inputs.sample_req_ids, params)):
                if p.logprobs is None:
                    continue
                k = 1 + p.logprobs
                logprobs[req_id] = SampleLogprobs(
                    token_ids=[ids[i][:k]], logprobs=[lps[i][:k]], ranks=[ranks[i]])
        return sampled, logprobs
