"""KV-cache size on a GPU from a profiling forward (``--max_gpu_memory_utilization``).

After the weights are loaded, one forward runs at the largest step the scheduler can build:
``--max_num_batched_tokens`` tokens over as many sequences as it allows (``--max_num_seqs``),
every one of them sampling with top-k / top-p / min-p and the most logprobs a request may ask
for; then the sampler alone runs its most expensive case on as many rows (top-p without top-k
over all-equal logits: full-row sorts and float64 ``[R, V]`` temporaries, about three times a
top-k step's memory). The peak of torch's reserved bytes over the weights is the activations'
share. Memory the process took outside torch since start-up (the CUDA context's growth, NCCL
buffers, compiled kernels) is what the device's free memory lost beyond torch's allocations, as
vLLM counts it. The KV cache gets what is left of ``utilization x total``:

    kv_bytes = utilization * total - weights - peak activations - non-torch

so a step that the scheduler may build can never run the device out of memory mid-serving. Too
little for one ``--max_model_len`` request is a start-up error that names the flags to change.
The arithmetic (``plan_kv_cache``) is a pure function; the forward (``profile_activations``)
reads memory through the platform's ``MemoryReader``, which tests fake.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bladellm.core.interface import NewRequestData, SchedulerOutput
from bladellm.platforms.cpu_defaults import KVCacheSizeError
from bladellm.platforms.interface import MemoryReader, MemorySnapshot
from bladellm.sample.metadata import SamplingMetadata
from bladellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
GiB = 1 << 30
PROFILE_LOGPROBS = 20  # the most a request may ask for (sampling_params._MAX_LOGPROBS)


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    utilization: float
    weight_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    kv_bytes: int
    bytes_per_block: int
    num_blocks: int
    block_size: int

    def describe(self) -> str:
        return (f"GPU memory: {self.utilization:.2f} x {self.total_bytes / GiB:.2f} GiB = "
                f"{self.utilization * self.total_bytes / GiB:.2f} GiB; weights "
                f"{self.weight_bytes / GiB:.2f} GiB, activations (profiled peak) "
                f"{self.activation_bytes / GiB:.2f} GiB, outside torch "
                f"{self.non_torch_bytes / GiB:.2f} GiB, KV cache {self.kv_bytes / GiB:.2f} GiB "
                f"= {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} tokens")


def plan_kv_cache(total_bytes: int, free_bytes_at_start: int, utilization: float,
                  weight_bytes: int, activation_bytes: int, bytes_per_block: int,
                  block_size: int, max_model_len: int,
                  non_torch_bytes: int = 0) -> MemoryPlan:
    """The KV cache of ``utilization x total - weights - activations - non-torch``.
    ``free_bytes_at_start``: the device's free memory before this engine allocated anything
    (other processes' share is not ours to take). Raises ``KVCacheSizeError`` naming the flags
    when the budget is short."""
    budget = int(utilization * total_bytes)
    if free_bytes_at_start < budget:
        raise KVCacheSizeError(
            f"--max_gpu_memory_utilization {utilization}: asks for {budget / GiB:.2f} GiB of the "
            f"GPU's {total_bytes / GiB:.2f} GiB, but only {free_bytes_at_start / GiB:.2f} GiB "
            f"were free at start-up (another process holds the rest); lower "
            f"--max_gpu_memory_utilization or free the GPU")
    kv_bytes = budget - weight_bytes - activation_bytes - non_torch_bytes
    num_blocks = max(0, kv_bytes) // bytes_per_block
    needed = -(-max_model_len // block_size) + 1  # one full-length request + the null block
    if num_blocks < needed:
        raise KVCacheSizeError(
            f"not enough GPU memory for the KV cache of one --max_model_len {max_model_len} "
            f"request: {utilization} x {total_bytes / GiB:.2f} GiB leaves "
            f"{max(0, kv_bytes) / GiB:.2f} GiB after the weights ({weight_bytes / GiB:.2f} GiB) "
            f"the activations of the largest step ({activation_bytes / GiB:.2f} GiB) and "
            f"memory outside torch ({non_torch_bytes / GiB:.2f} GiB), "
            f"{num_blocks} blocks of the {needed} it needs. Raise "
            f"--max_gpu_memory_utilization, lower --max_model_len, lower "
            f"--max_num_batched_tokens or --max_num_seqs (smaller activations), or shrink the "
            f"weights / KV (--quantization, --kv_cache_quant int8, --tensor_parallel_size)")
    return MemoryPlan(total_bytes=total_bytes, utilization=utilization,
                      weight_bytes=weight_bytes, activation_bytes=activation_bytes,
                      non_torch_bytes=non_torch_bytes,
                      kv_bytes=num_blocks * bytes_per_block, bytes_per_block=bytes_per_block,
                      num_blocks=num_blocks, block_size=block_size)


def profile_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int, vocab_size: int) -> tuple[SchedulerOutput, int]:
    """(the largest step the scheduler can build, the KV blocks it writes): the token budget
    spread over as many new sequences as it allows, each prefilling its whole prompt in one
    chunk (so every one samples), with every sampling filter and the most logprobs on.
    Block ids start at 1 (0 is the null block)."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    lens = [max_num_batched_tokens // num_seqs] * num_seqs
    for i in range(max_num_batched_tokens % num_seqs):
        lens[i] += 1
    lens = [min(n, max_model_len) for n in lens]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01,
                            logprobs=PROFILE_LOGPROBS, max_tokens=1)
    sched = SchedulerOutput()
    next_block = 1
    for i, n in enumerate(lens):
        num_blocks = -(-n // block_size)
        req_id = f"profile-{i}"
        tokens = [(i * 7919 + j) % vocab_size for j in range(n)]
        sched.scheduled_new_reqs.append(NewRequestData(
            req_id=req_id, token_ids=tokens, num_prompt_tokens=n, sampling_params=params,
            block_ids=list(range(next_block, next_block + num_blocks)), num_computed_tokens=0))
        sched.num_scheduled_tokens[req_id] = n
        next_block += num_blocks
    sched.total_num_scheduled_tokens = sum(lens)
    return sched, next_block


@dataclass(frozen=True)
class ProfiledMemory:
    activation_bytes: int  # peak torch bytes of the largest step over what was held before it
    non_torch_bytes: int  # taken by this process since start-up outside torch's allocator


def _reserved_now(reader: MemoryReader) -> int:
    """The allocator's reserved bytes, its unused cache released (a peak window just reset
    reads what is reserved now)."""
    reader.release_cached()
    reader.reset_peak()
    return reader.snapshot().peak


def profile_sampler(sampler, num_rows: int, vocab_size: int, device: torch.device) -> None:
    """The sampler's most memory-hungry step on ``num_rows`` rows: top-p 0.999 without top-k
    sorts whole rows (sample/draw.py) with float64 ``[R, V]`` temporaries, and all-zero logits
    tie every token, so no candidate shortcut covers a row; the most logprobs on top."""
    logits = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    md = SamplingMetadata(
        temperature=torch.ones(num_rows, dtype=torch.float32, device=device), all_greedy=False,
        all_random=True, top_p=torch.full((num_rows,), 0.999, dtype=torch.float32,
                                          device=device),
        top_k=None, min_p=None, max_num_logprobs=PROFILE_LOGPROBS)
    sampler(logits, md, inplace=True)


def profile_activations(runner, reader: MemoryReader, synchronize: Callable[[], None],
                        max_num_batched_tokens: int, max_num_seqs: int, vocab_size: int,
                        at_start: MemorySnapshot) -> ProfiledMemory:
    """Peak bytes the largest step allocates beyond what was held before it (weights and
    everything loaded), measured with ``reader``: the step runs through ``runner`` (a
    ``ModelRunner``: the real inputs, forward, logits and sampler) on a scratch KV cache just
    large enough, which is freed after, and whose bytes are not counted; then the sampler's
    largest case (``profile_sampler``). ``at_start``: the reader's snapshot before the weights
    were loaded, from which memory taken outside torch is counted."""
    sched, num_blocks = profile_step(max_num_batched_tokens, max_num_seqs, runner.max_model_len,
                                     runner.block_size, vocab_size)
    reader.release_cached()
    reader.reset_peak()
    base = reader.snapshot().peak
    runner.initialize_kv_cache(num_blocks, capture_graphs=False)
    scratch = num_blocks * (runner.bytes_per_block + runner.spec_bytes_per_block)
    graph_bytes = 0
    try:
        runner.execute_model(sched)
        profile_sampler(runner.sampler, len(sched.scheduled_new_reqs), vocab_size,
                        runner.device)
        synchronize()
        peak = reader.snapshot().peak
        graphs = getattr(runner, "graphs", None)
        if graphs is not None and graphs.capture_enabled:
            # Held while serving, beside any step's activations: counted on top of the peak.
            graph_bytes = graphs.measure(runner._forward, max_num_batched_tokens,
                                         lambda: _reserved_now(reader))
            logger.info("CUDA graphs: %.0f MiB (static inputs and the largest graph's pool) "
                        "counted with the activations", graph_bytes / (1 << 20))
    finally:
        runner.drop_requests([r.req_id for r in sched.scheduled_new_reqs])
        runner.kv_caches = []  # the scratch cache goes; the real one is sized next
        if runner.spec_bytes_per_block:
            runner.spec.proposer.kv_caches = []
        reader.release_cached()
    now = reader.snapshot()
    # What free memory lost since start-up beyond torch's own allocations (cached blocks count
    # as free on both sides: MemorySnapshot.free).
    non_torch = ((at_start.free - now.free)
                 - (now.torch_allocated - at_start.torch_allocated))
    return ProfiledMemory(activation_bytes=max(0, peak - base - scratch) + graph_bytes,
                          non_torch_bytes=max(0, non_torch))
