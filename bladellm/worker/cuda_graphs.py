"""CUDA graphs for decode steps (and verification steps of one query length per request).

A step whose requests all run the same number of query tokens ``q`` (decode: 1; an sps
verification: 1 + k) and carry no token tree is *graphable*. Its batch of ``n`` requests is
padded to the smallest captured size ``>= n`` (above the largest: eager) and its inputs are
copied into static buffers that the captured graph reads:

- padded requests own ``q`` tokens each at positions ``0 .. q-1`` of a context of ``q`` tokens,
  with an all-zero block table row: block 0 is the null block (``core/block_pool.py``: never
  handed to a request), so their K/V writes land in it and never in a real request's KV;
- ``query_start_loc`` is ``0, q, 2q, ...`` for every row, real or padded;
- the model's output is sliced back to the real tokens; padded rows' hidden states are never
  read (logits indices point at real tokens only).

The logic (sizes, selection, padding, slicing) is platform-neutral: on a CPU the same padded
static-buffer step runs eagerly when a test asks for it (``StepGraphs(capture=False)``), which
is how it is checked without a GPU. On CUDA the graphs are captured once at start-up, after the
KV cache exists, largest first into one shared memory pool; what they hold is measured in the
profiling run that sizes the KV cache (``measure``, worker/memory_profile.py).

Only the model forward (to hidden states) is captured: the LM head, the sampler and the
verification run eagerly on the sliced rows, so everything after the forward is the eager code.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from bladellm.attention.backend import AttentionMetadata
from bladellm.config import EngineConfig
from bladellm.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 512  # vLLM's default largest capture size
NUM_WARMUP_RUNS = 2  # eager runs before a capture: lazy inits, Triton compiles, autotuning
MiB = 1 << 20


def default_batch_sizes(cap: int) -> list[int]:
    """vLLM's capture list: 1, 2, 4, multiples of 8 up to 256, then of 16, all ``<= cap``;
    ``cap`` itself is added when missing, so that every batch up to it is padded, not eager."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, DEFAULT_MAX_BATCH_SIZE + 1, 16))
    sizes = [s for s in sizes if s <= cap]
    if cap not in sizes:
        sizes.append(cap)
    return sizes


def batch_sizes(config: EngineConfig) -> list[int]:
    """The sizes to capture (ascending): ``--cuda_graph_batch_sizes``, else the default list
    capped by ``--cuda_graph_max_batch_size`` (default 512), ``--max_num_seqs`` and
    ``--max_num_batched_tokens`` (a decode batch has one token per request)."""
    model, sched = config.model, config.scheduler
    if model.cuda_graph_batch_sizes is not None:
        return sorted(model.cuda_graph_batch_sizes)
    cap = min(model.cuda_graph_max_batch_size or DEFAULT_MAX_BATCH_SIZE, sched.max_num_seqs,
              sched.max_num_batched_tokens)
    return default_batch_sizes(cap)


def graph_query_lens(config: EngineConfig) -> tuple[int, ...]:
    """Query tokens per request of the step shapes to capture: decode (1), and with
    ``--decode_algo sps`` its full verification (1 + gamma). look_ahead verifies a token tree,
    which runs eagerly (its masked attention plans on the host per request)."""
    spec = config.speculative
    if spec.decode_algo == "sps":
        return (1, 1 + spec.gamma)
    return (1,)


def pad_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest of ``sizes`` (ascending) at or above ``num_reqs``; None above the largest."""
    i = int(np.searchsorted(sizes, num_reqs))
    return sizes[i] if i < len(sizes) else None


class GraphKey(NamedTuple):
    num_reqs: int  # requests after padding
    query_len: int  # query tokens of every request

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.query_len


def graph_key(md: AttentionMetadata, sizes: list[int], query_lens: tuple[int, ...]
              ) -> GraphKey | None:
    """The padded shape of a step, or None when it runs eagerly: a prefill or mixed step (the
    requests' query lengths differ, or are not a captured length), a token tree, or more
    requests than the largest size."""
    q = md.max_query_len
    # Every q_i is between 1 and the maximum, so the total equals n * max only when all are equal.
    if md.tree is not None or q not in query_lens or md.num_actual_tokens != md.num_reqs * q:
        return None
    size = pad_size(sizes, md.num_reqs)
    return None if size is None else GraphKey(size, q)


class StaticStepBuffers:
    """The tensors a graph reads, sized for the largest key; a step is copied into their
    prefixes and the rows after it are set to padding (null block, dummy slots)."""

    def __init__(self, max_reqs: int, max_tokens: int, table_width: int, num_extra_groups: int,
                 block_size: int, max_model_len: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.block_size = block_size
        self.max_model_len = max_model_len
        self.input_ids = zeros(max_tokens, dtype=torch.int64)
        self.positions = zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = zeros(max_tokens, dtype=torch.int64)
        self.query_start_loc = zeros(max_reqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_reqs, dtype=torch.int32)
        self.block_tables = zeros(max_reqs, table_width, dtype=torch.int32)
        # Hybrid KV cache groups after the first: their own tables and slots.
        self.groups = [(zeros(max_reqs, table_width, dtype=torch.int32),
                        zeros(max_tokens, dtype=torch.int64)) for _ in range(num_extra_groups)]
        # Padding tokens: request r (padded) token j sits at position j, slot j % block_size
        # of the null block.
        self._max_reqs, self._max_tokens, self._device = max_reqs, max_tokens, device
        self._pad: dict[int, tuple[torch.Tensor, ...]] = {}

    def _padding(self, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, slots, query_start_loc) of padded requests of ``q`` tokens, on the
        device once, so that a step copies them device to device."""
        if q not in self._pad:
            pos = torch.arange(self._max_tokens, dtype=torch.int64) % q
            qsl = torch.arange(self._max_reqs + 1, dtype=torch.int32) * q
            self._pad[q] = tuple(t.to(self._device) for t in (pos, pos % self.block_size, qsl))
        return self._pad[q]

    def fill(self, inputs: StepInputs | None, key: GraphKey) -> StepInputs:
        """The step padded to ``key`` in the static buffers (``inputs`` None: every row is
        padding, for warm-up and capture). Only the flat inputs and attention metadata are
        the buffers'; the rest of the returned ``StepInputs`` is the step's own."""
        q, size, total = key.query_len, key.num_reqs, key.num_tokens
        n = 0 if inputs is None else inputs.attn_metadata.num_reqs
        t = n * q
        pad_pos, pad_slots, pad_qsl = self._padding(q)
        ids, pos, slots = self.input_ids, self.positions, self.slot_mapping
        tables, lens = self.block_tables, self.seq_lens
        if inputs is not None:
            md = inputs.attn_metadata
            ids[:t].copy_(inputs.input_ids, non_blocking=True)
            pos[:t].copy_(inputs.positions, non_blocking=True)
            slots[:t].copy_(md.slot_mapping, non_blocking=True)
            lens[:n].copy_(md.seq_lens, non_blocking=True)
            # Entries past a row's blocks may be stale: no kernel reads past seq_lens.
            tables[:n, :md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        ids[t:total].zero_()
        pos[t:total].copy_(pad_pos[:total - t])
        slots[t:total].copy_(pad_slots[:total - t])
        lens[n:size].fill_(q)
        tables[n:size].zero_()
        group_tables = None
        if self.groups:
            group_tables = []
            real = [] if inputs is None else inputs.group_tables
            for g, (g_tables, g_slots) in enumerate(self.groups):
                if inputs is not None:
                    src_tables, src_slots = real[g]
                    g_tables[:n, :src_tables.shape[1]].copy_(src_tables, non_blocking=True)
                    g_slots[:t].copy_(src_slots, non_blocking=True)
                g_tables[n:size].zero_()
                g_slots[t:total].copy_(pad_slots[:total - t])
                group_tables.append((g_tables[:size], g_slots[:total]))
        self.query_start_loc[:size + 1].copy_(pad_qsl[:size + 1])
        qsl_host = np.arange(size + 1, dtype=np.int32) * q
        seq_host = np.full(size, q, np.int32)
        if inputs is not None:
            seq_host[:n] = inputs.attn_metadata.seq_lens_cpu
        # max_seq_len: the bound a capture must assume (it sizes split-K work only).
        md = AttentionMetadata(
            num_reqs=size, num_actual_tokens=total, max_query_len=q,
            max_seq_len=self.max_model_len, query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=lens[:size], block_tables=tables[:size], slot_mapping=slots[:total],
            query_start_loc_cpu=qsl_host, seq_lens_cpu=seq_host)
        lora_ids = None if inputs is None else inputs.token_lora_ids
        if lora_ids is not None:
            lora_ids = np.concatenate([lora_ids, np.zeros(total - t, lora_ids.dtype)])
        base = inputs if inputs is not None else StepInputs(
            req_ids=[], input_ids=ids, positions=pos, attn_metadata=md,
            sample_indices=np.zeros(0, np.int64), logits_indices=torch.zeros(0, dtype=torch.int64),
            sampling=None)
        return replace(base, input_ids=ids[:total], positions=pos[:total], attn_metadata=md,
                       token_lora_ids=lora_ids if lora_ids is not None
                       else np.zeros(total, np.int64), group_tables=group_tables)


Forward = Callable[[StepInputs], torch.Tensor]


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    output: torch.Tensor  # the graph's hidden states [num_tokens, hidden]


class StepGraphs:
    """The runner's graphable steps: which they are, their padding, and (``capture=True``, on
    CUDA) the captured graphs. With ``capture=False`` a graphable step runs eagerly through the
    same padded static buffers (the CPU check of the padding)."""

    def __init__(self, sizes: list[int], query_lens: tuple[int, ...], buffers_factory:
                 Callable[[int, int], StaticStepBuffers], capture: bool) -> None:
        self.sizes = sorted(sizes)
        self.query_lens = tuple(sorted(query_lens))
        self.capture_enabled = capture
        self._factory = buffers_factory
        self.buffers: StaticStepBuffers | None = None
        self.graphs: dict[GraphKey, _Captured] = {}
        self._kv_caches: list[torch.Tensor] | None = None  # what the graphs were captured on
        self._pool = None
        # Steps run per key, and their padded requests (logged and read by tests).
        self.num_steps: Counter[GraphKey] = Counter()
        self.num_padded_reqs = 0

    @property
    def keys(self) -> list[GraphKey]:
        return [GraphKey(s, q) for q in self.query_lens for s in self.sizes]

    def _ensure_buffers(self) -> StaticStepBuffers:
        if self.buffers is None:
            self.buffers = self._factory(max(self.sizes),
                                         max(k.num_tokens for k in self.keys))
        return self.buffers

    def key_of(self, inputs: StepInputs) -> GraphKey | None:
        key = graph_key(inputs.attn_metadata, self.sizes, self.query_lens)
        if key is not None and self.capture_enabled and key not in self.graphs:
            return None  # not captured (e.g. over the token budget): eager
        return key

    def run(self, key: GraphKey, inputs: StepInputs, forward: Forward,
            kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states of the step's real tokens, from the padded step."""
        padded = self._ensure_buffers().fill(inputs, key)
        num_tokens = inputs.attn_metadata.num_actual_tokens
        self.num_steps[key] += 1
        self.num_padded_reqs += key.num_reqs - inputs.attn_metadata.num_reqs
        if not self.capture_enabled:
            return forward(padded)[:num_tokens]
        if kv_caches is not self._kv_caches:
            raise RuntimeError("CUDA graphs were captured on another KV cache; recapture "
                               "after initialize_kv_cache")
        captured = self.graphs[key]
        captured.graph.replay()
        return captured.output[:num_tokens]

    # ---- capture (CUDA) -------------------------------------------------------------------------
    def _capture_one(self, key: GraphKey, forward: Forward) -> _Captured:
        padded = self._ensure_buffers().fill(None, key)
        for _ in range(NUM_WARMUP_RUNS):
            forward(padded)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward(padded)
        torch.cuda.synchronize()
        return _Captured(graph, output)

    # Start-up calls these outside the step's inference mode: without it the warm-up and the
    # capture would record autograd state (and the measure count it).
    @torch.inference_mode()
    def capture(self, forward: Forward, kv_caches: list[torch.Tensor],
                max_num_tokens: int) -> None:
        """Capture every key (largest first: the smaller graphs reuse its pool memory) whose
        tokens fit ``max_num_tokens``; one log line each."""
        self.graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
        self._kv_caches = kv_caches
        start = time.perf_counter()
        keys = sorted((k for k in self.keys if k.num_tokens <= max_num_tokens),
                      key=lambda k: (k.num_tokens, k.num_reqs), reverse=True)
        for key in keys:
            t0 = time.perf_counter()
            try:
                self.graphs[key] = self._capture_one(key, forward)
            except Exception as exc:
                raise RuntimeError(f"CUDA graph capture failed for {key.num_reqs} requests x "
                                   f"{key.query_len} tokens: {exc}; run with "
                                   f"--disable_cuda_graph") from exc
            logger.info("CUDA graph captured: %d requests x %d query tokens (%.0f ms)",
                        key.num_reqs, key.query_len, (time.perf_counter() - t0) * 1e3)
        logger.info("CUDA graphs: %d captured in %.1f s (sizes %s, query lengths %s)",
                    len(self.graphs), time.perf_counter() - start, self.sizes, self.query_lens)

    @torch.inference_mode()
    def measure(self, forward: Forward, max_num_tokens: int,
                reserved: Callable[[], int]) -> int:
        """Bytes the graphs will hold while serving, measured on the scratch KV cache of the
        profiling run: the static buffers and the pool of the largest graph (the others share
        it). ``reserved``: the allocator's reserved bytes now, cached blocks released. The
        graph is dropped after; ``capture`` runs on the real KV cache."""
        before = reserved()
        self._pool = torch.cuda.graph_pool_handle()
        keys = [k for k in self.keys if k.num_tokens <= max_num_tokens]
        largest = max(keys, key=lambda k: (k.num_tokens, k.num_reqs))
        captured = self._capture_one(largest, forward)
        held = reserved() - before
        del captured
        self._pool = None
        return max(0, held)


def check_graph_flags(config: EngineConfig, device: torch.device) -> None:
    """The graph size flags on a device that captures no graph: refused, never ignored
    (``--device cpu`` is refused by the config; this covers ``--device auto`` on a CPU)."""
    if device.type != "cuda" and config.model.sets_cuda_graph_sizes:
        flag = config.model.cuda_graph_size_flag
        raise ValueError(f"--{flag}: CUDA graphs are captured on GPU devices only, and "
                         f"--device {config.device} runs on {device.type}; drop the flag")


def make_step_graphs(config: EngineConfig, device: torch.device, model: torch.nn.Module,
                     buffers_factory: Callable[[int, int], StaticStepBuffers],
                     eager_padding: bool = False) -> StepGraphs | None:
    """The runner's ``StepGraphs`` on CUDA (None where graphs are off, with the reason logged
    once). ``eager_padding``: the CPU check path, the padded static-buffer steps without
    capture (an internal runner option; no flag)."""
    check_graph_flags(config, device)
    if eager_padding:
        reason = _graphs_off_reason(config, model)
        if reason is not None and not reason.startswith("not built for mixture"):
            raise ValueError(f"padded steps: {reason}")
        return StepGraphs(batch_sizes(config), graph_query_lens(config), buffers_factory,
                          capture=False)
    if device.type != "cuda":
        return None
    reason = _graphs_off_reason(config, model)
    if reason is not None:
        if config.model.sets_cuda_graph_sizes and reason.startswith("not built"):
            raise ValueError(f"--{config.model.cuda_graph_size_flag}: CUDA graphs are "
                             f"{reason}")
        logger.info("CUDA graphs off: %s", reason)
        return None
    return StepGraphs(batch_sizes(config), graph_query_lens(config), buffers_factory,
                      capture=True)


def _graphs_off_reason(config: EngineConfig, model: torch.nn.Module) -> str | None:
    from bladellm.model.layers.fused_moe import moe_layers

    if config.model.disable_cuda_graph:
        return "--disable_cuda_graph"
    if config.model.enforce_eager:
        return "--enforce_eager"
    if config.parallel.pipeline_parallel_size > 1:
        return "not built for --pipeline_parallel_size > 1 (stage sends in the forward)"
    if hasattr(model, "encode_image") or hasattr(model, "mrope_positions"):
        return "not built for vision-language models (image embeddings, M-RoPE positions)"
    if moe_layers(model):
        return "not built for mixture-of-experts models (the MoE kernel sizes its GEMM on " \
               "the host)"
    return None
