"""KV cache sized by a profiling forward (--max_gpu_memory_utilization): the arithmetic and its
errors, the profiling step, and the worker's path through it, on CPU with a faked device-memory
reader."""

from __future__ import annotations

import pytest
import torch

from bladellm.config import EngineConfig
from bladellm.platforms.cpu_defaults import KVCacheSizeError
from bladellm.platforms.cpu_platform import CpuPlatform
from bladellm.platforms.interface import MemoryReader, MemorySnapshot
from bladellm.worker import worker as worker_mod
from bladellm.worker.memory_profile import plan_kv_cache, profile_step

GiB = 1 << 30


def test_plan_gives_the_kv_cache_what_is_left():
    plan = plan_kv_cache(total_bytes=80 * GiB, free_bytes_at_start=79 * GiB, utilization=0.9,
                         weight_bytes=16 * GiB, activation_bytes=4 * GiB,
                         bytes_per_block=2 * (1 << 20), block_size=16, max_model_len=8192)
    budget = int(0.9 * 80 * GiB) - 16 * GiB - 4 * GiB
    assert plan.num_blocks == budget // (2 << 20)
    assert plan.kv_bytes == plan.num_blocks * (2 << 20) <= budget
    text = plan.describe()
    assert "weights 16.00 GiB" in text and "activations (profiled peak) 4.00 GiB" in text
    assert f"{plan.num_blocks} blocks x 16 tokens = {plan.num_blocks * 16} tokens" in text


def test_too_little_for_one_request_names_the_flags():
    with pytest.raises(KVCacheSizeError) as e:
        plan_kv_cache(total_bytes=24 * GiB, free_bytes_at_start=24 * GiB, utilization=0.9,
                      weight_bytes=16 * GiB, activation_bytes=5 * GiB,
                      bytes_per_block=128 << 20, block_size=16, max_model_len=131072)
    msg = str(e.value)
    for flag in ("--max_gpu_memory_utilization", "--max_model_len 131072",
                 "--max_num_batched_tokens", "--kv_cache_quant int8"):
        assert flag in msg
    # Exactly enough for one full-length request (+ the null block) passes.
    need = (131072 // 16 + 1) * (1 << 20)
    plan = plan_kv_cache(total_bytes=100 * GiB, free_bytes_at_start=100 * GiB,
                         utilization=1.0, weight_bytes=100 * GiB - need, activation_bytes=0,
                         bytes_per_block=1 << 20, block_size=16, max_model_len=131072)
    assert plan.num_blocks == 131072 // 16 + 1


def test_memory_outside_torch_is_charged_before_the_kv_cache():
    plan = plan_kv_cache(total_bytes=80 * GiB, free_bytes_at_start=79 * GiB, utilization=0.9,
                         weight_bytes=16 * GiB, activation_bytes=4 * GiB,
                         bytes_per_block=1 << 20, block_size=16, max_model_len=8192,
                         non_torch_bytes=GiB)
    assert plan.num_blocks == (int(0.9 * 80 * GiB) - 21 * GiB) // (1 << 20)
    assert "outside torch 1.00 GiB" in plan.describe()


def test_memory_held_by_another_process_is_an_error():
    with pytest.raises(KVCacheSizeError, match="only 10.00 GiB were free at start-up"):
        plan_kv_cache(total_bytes=80 * GiB, free_bytes_at_start=10 * GiB, utilization=0.9,
                      weight_bytes=GiB, activation_bytes=GiB, bytes_per_block=1 << 20,
                      block_size=16, max_model_len=1024)


def test_profile_step_is_the_largest_step_the_scheduler_builds():
    sched, num_blocks = profile_step(max_num_batched_tokens=100, max_num_seqs=8,
                                     max_model_len=64, block_size=16, vocab_size=50)
    assert len(sched.scheduled_new_reqs) == 8
    assert sched.total_num_scheduled_tokens == 100 == sum(sched.num_scheduled_tokens.values())
    blocks = [b for r in sched.scheduled_new_reqs for b in r.block_ids]
    assert blocks == list(range(1, num_blocks))  # disjoint, the null block 0 unused
    for r in sched.scheduled_new_reqs:
        assert r.num_prompt_tokens == len(r.token_ids) == sched.num_scheduled_tokens[r.req_id]
        assert max(r.token_ids) < 50 and r.sampling_params.logprobs == 20
        assert r.sampling_params.top_k > 0 and r.sampling_params.top_p < 1
    # Fewer tokens than sequences: one token each; a prompt never passes max_model_len.
    sched, _ = profile_step(4, 256, 64, 16, 50)
    assert list(sched.num_scheduled_tokens.values()) == [1, 1, 1, 1]
    sched, _ = profile_step(1000, 2, 64, 16, 50)
    assert list(sched.num_scheduled_tokens.values()) == [64, 64]


class FakeReader(MemoryReader):
    """A device of ``total`` bytes whose allocator peaks ``activations`` over its base while a
    forward runs (any forward: the test checks it ran one). Once it has run, torch holds
    ``weights`` and the process ``non_torch`` more outside torch, both gone from ``free``."""

    def __init__(self, total: int, activations: int, weights: int = 0,
                 non_torch: int = 0) -> None:
        self.total, self.activations = total, activations
        self.weights, self.non_torch = weights, non_torch
        self.base, self.scratch = 3 * GiB, 0
        self.resets = 0
        self.ran_forward = False
        self.log: list[str] = []

    def snapshot(self) -> MemorySnapshot:
        self.log.append("snapshot")
        peak = self.base + (self.scratch + self.activations if self.ran_forward else 0)
        held = self.weights + self.non_torch if self.ran_forward else 0
        return MemorySnapshot(total=self.total, free=self.total - held, peak=peak,
                              torch_allocated=self.weights if self.ran_forward else 0)

    def reset_peak(self) -> None:
        self.resets += 1

    def release_cached(self) -> None:
        self.log.append("release")


class ProfilingCpu(CpuPlatform):
    """A CPU that sizes its KV cache by profiling, as a GPU does, with a faked memory reader."""

    sizes_kv_cache_by_profiling = True

    def __init__(self, reader: FakeReader) -> None:
        self.reader = reader

    def memory_reader(self, device):
        return self.reader


def test_worker_sizes_the_kv_cache_from_a_profiled_forward(tiny_llama, monkeypatch):
    reader = FakeReader(total=8 * GiB, activations=GiB // 2, weights=GiB, non_torch=GiB // 4)
    monkeypatch.setattr(worker_mod, "resolve_platform", lambda device: ProfilingCpu(reader))
    from bladellm.model.loader import resolve_model

    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", max_model_len=64,
                                   max_num_batched_tokens=96, max_num_seqs=4,
                                   max_gpu_memory_utilization=0.5)
    w = worker_mod.Worker(cfg, resolve_model(cfg.model))
    runner = w.model_runner
    real_execute = runner.execute_model
    seen = {}

    def execute(sched):
        seen["tokens"] = sched.total_num_scheduled_tokens
        reader.scratch = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        out = real_execute(sched)
        reader.ran_forward = True
        seen["sampled"] = [ids for ids in out.sampled_token_ids]
        seen["logprobs"] = len(out.logprobs)
        return out

    monkeypatch.setattr(runner, "execute_model", execute)
    sampled = []
    real_sampler = runner.sampler

    def sampler(logits, md, **kw):
        sampled.append((tuple(logits.shape), md.top_k, md.top_p, md.max_num_logprobs))
        return real_sampler(logits, md, **kw)

    monkeypatch.setattr(runner, "sampler", sampler)
    num_blocks = w.determine_num_blocks()
    # After the forward, the sampler alone at its largest: top-p without top-k on every row.
    shape, top_k, top_p, num_logprobs = sampled[-1]
    assert shape == (4, w.vocab_size) and top_k is None and num_logprobs == 20
    assert torch.all(top_p == 0.999) and len(sampled) == 2
    assert seen["tokens"] == 96 and all(len(ids) == 1 for ids in seen["sampled"])
    assert seen["logprobs"] == 4  # every profiled sequence asked for logprobs
    from bladellm.worker.worker import model_weight_bytes

    weights = model_weight_bytes(runner.model) + runner.packed_weight_bytes
    # Outside torch: what free memory lost beyond torch's allocations since start-up.
    expected = (int(0.5 * 8 * GiB) - weights - GiB // 2 - GiB // 4) // runner.bytes_per_block
    assert num_blocks == expected and reader.resets == 1
    # The runner is left as it was: no rows, no cache; the real cache then serves.
    assert runner.kv_caches == [] and not runner.input_batch.row_of
    w.initialize_kv_cache(16)
    assert runner.kv_caches[0].shape[1] == 16


def test_worker_profile_too_small_is_a_start_up_error(tiny_llama, monkeypatch):
    reader = FakeReader(total=GiB // 8, activations=GiB // 16)
    monkeypatch.setattr(worker_mod, "resolve_platform", lambda device: ProfilingCpu(reader))
    from bladellm.model.loader import resolve_model

    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", max_model_len=64,
                                   max_num_batched_tokens=64, max_num_seqs=2,
                                   max_gpu_memory_utilization=0.5)
    w = worker_mod.Worker(cfg, resolve_model(cfg.model))
    w.model_runner.execute_model = lambda s, f=w.model_runner.execute_model: (
        setattr(reader, "ran_forward", True), f(s))[1]
    with pytest.raises(KVCacheSizeError, match="--max_gpu_memory_utilization"):
        w.determine_num_blocks()


def test_explicit_kv_size_is_checked_against_the_device(tiny_llama, monkeypatch):
    reader = FakeReader(total=GiB // 1024, activations=0)  # a 1 MiB "GPU"
    monkeypatch.setattr(worker_mod, "resolve_platform", lambda device: ProfilingCpu(reader))
    from bladellm.model.loader import resolve_model

    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", max_model_len=64,
                                   num_kv_blocks=100000)
    w = worker_mod.Worker(cfg, resolve_model(cfg.model))
    with pytest.raises(KVCacheSizeError, match="--num_kv_blocks"):
        w.determine_num_blocks()


def test_worker_frees_the_cache_before_its_first_read_and_at_shutdown(tiny_llama, monkeypatch):
    """A second engine in one process: the first one's garbage and torch's cached blocks are
    freed before the new worker reads what is free, and shutting an engine down (its in-process
    executor) lets go of its model and KV cache (freed at once) and empties torch's cache."""
    import gc
    import types
    import weakref

    from bladellm.executor.uniproc import UniProcExecutor
    from bladellm.model.loader import resolve_model

    reader = FakeReader(total=8 * GiB, activations=0)
    monkeypatch.setattr(worker_mod, "resolve_platform", lambda device: ProfilingCpu(reader))
    monkeypatch.setattr(worker_mod, "gc", types.SimpleNamespace(
        collect=lambda: (reader.log.append("gc"), gc.collect())[1]))
    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", max_model_len=64,
                                   max_gpu_memory_utilization=0.5)
    executor = UniProcExecutor(cfg, resolve_model(cfg.model))
    assert reader.log[:3] == ["gc", "release", "snapshot"]
    runner = executor.worker.model_runner
    runner.initialize_kv_cache(8)
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    del runner
    reader.log.clear()
    executor.shutdown()
    assert reader.log == ["release"]  # no collection at shutdown: the next start-up runs one
    assert cache() is None and executor.worker.model_runner is None
    gc.collect()
    assert model() is None  # nothing but its own cycles held it
    executor.shutdown()  # twice: nothing more to do


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_sizes_by_profile(tiny_llama, caplog):
    import logging

    from bladellm.model.loader import resolve_model

    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", device="cuda",
                                   max_model_len=64, max_gpu_memory_utilization=0.5)
    with caplog.at_level(logging.INFO):
        w = worker_mod.Worker(cfg, resolve_model(cfg.model, device="cuda"))
        n = w.determine_num_blocks()
    assert n > 64 // 16 + 1 and "GPU memory: 0.50 x" in caplog.text
