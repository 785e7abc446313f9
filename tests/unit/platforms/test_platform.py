"""--device: the platform chosen at start-up from (faked) torch.cuda availability, what each
platform answers, and the worker's refusals."""

from __future__ import annotations

import logging

import pytest
import torch

from bladellm.config import EngineConfig
from bladellm.platforms.cpu_platform import CpuPlatform, mem_available_bytes
from bladellm.platforms.cuda import CudaPlatform
from bladellm.platforms.select import platform_of, resolve_platform
from bladellm.worker.worker import check_platform_flags


@pytest.mark.parametrize("available, expected", [(True, "cuda"), (False, "cpu")])
def test_auto_follows_cuda_availability(available, expected):
    platform = resolve_platform("auto", cuda_available=lambda: available)
    assert platform.name == expected
    assert platform.dist_backend == {"cuda": "nccl", "cpu": "gloo"}[expected]
    assert platform.auto_kernel_set == {"cuda": "triton", "cpu": "compiled"}[expected]
    assert platform.sizes_kv_cache_by_profiling == (expected == "cuda")
    assert platform.supports_pinned_memory == (expected == "cuda")


def test_auto_reads_torch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(resolve_platform("auto"), CudaPlatform)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(resolve_platform("auto"), CpuPlatform)


def test_explicit_cuda_without_a_gpu_names_the_flag():
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        resolve_platform("cuda", cuda_available=lambda: False)
    assert resolve_platform("cpu", cuda_available=lambda: True).name == "cpu"
    with pytest.raises(ValueError, match="--device: must be one of auto, cpu, cuda"):
        resolve_platform("tpu")


def test_config_device_flag():
    assert EngineConfig().device == "auto"
    with pytest.raises(ValueError, match="--device"):
        EngineConfig(device="rocm")
    cfg = EngineConfig.from_kwargs(device="cuda", max_gpu_memory_utilization=0.5)
    assert cfg.cache.max_gpu_memory_utilization == 0.5 and cfg.device == "cuda"


def test_config_refuses_gpu_utilization_on_explicit_cpu():
    from bladellm.config import CacheConfig

    with pytest.raises(ValueError, match="--max_gpu_memory_utilization"):
        EngineConfig(device="cpu", cache=CacheConfig(max_gpu_memory_utilization=0.5))
    assert CacheConfig().max_gpu_memory_utilization == 0.90


def test_worker_refuses_what_the_platform_cannot_honour():
    from bladellm.config import CacheConfig, LoRAConfig

    util = EngineConfig(device="auto", cache=CacheConfig(max_gpu_memory_utilization=0.5))
    with pytest.raises(ValueError, match="--max_gpu_memory_utilization: applies to GPU"):
        check_platform_flags(CpuPlatform(), util)
    check_platform_flags(CudaPlatform(), util)  # honoured there
    lora = EngineConfig(lora=LoRAConfig(enable_lora=True))
    check_platform_flags(CpuPlatform(), lora)
    with pytest.raises(ValueError, match="--enable_lora: LoRA adapters do not run on cuda"):
        check_platform_flags(CudaPlatform(), lora)
    from bladellm.config import SpeculativeConfig

    spec = EngineConfig(speculative=SpeculativeConfig(decode_algo="look_ahead"))
    check_platform_flags(CpuPlatform(), spec)
    with pytest.raises(ValueError, match="--decode_algo look_ahead"):
        check_platform_flags(CudaPlatform(), spec)


def test_cuda_auto_dtype_keeps_16_bit_checkpoints():
    cuda = CudaPlatform()
    assert cuda.auto_dtype("bfloat16")[0] == "bfloat16"
    assert cuda.auto_dtype("float16")[0] == "float16"
    assert cuda.auto_dtype("float32")[0] == "bfloat16"
    assert cuda.auto_dtype(None)[0] == "bfloat16"


def test_resolve_dtype_per_device(monkeypatch, caplog):
    from types import SimpleNamespace

    from bladellm.model.loader import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hf = SimpleNamespace(torch_dtype=torch.float16)
    with caplog.at_level(logging.INFO):
        assert resolve_dtype(hf, "auto", "cuda") == torch.float16
        assert resolve_dtype(SimpleNamespace(torch_dtype=torch.float32), "auto",
                             "auto") == torch.bfloat16
    assert "dtype auto: bfloat16" in caplog.text
    assert resolve_dtype(hf, "float32", "cuda") == torch.float32


def test_platform_of_a_device():
    assert platform_of(torch.device("cpu")).name == "cpu"
    assert platform_of("cuda:1").name == "cuda"


def test_kernel_set_for_auto_follows_the_platform(monkeypatch):
    from bladellm.kernels import resolve_kernels

    with pytest.raises(ValueError, match="--kernels compiled: .* runs on cuda"):
        resolve_kernels("compiled", torch.device("cuda", 0))


def test_cpu_memory_reader():
    meminfo = "MemTotal:  1000 kB\nMemAvailable:   512 kB\n"
    assert mem_available_bytes(meminfo) == 512 * 1024
    assert mem_available_bytes("MemTotal: 1 kB") is None
    snap = CpuPlatform().memory_reader(torch.device("cpu")).snapshot()
    assert 0 < snap.free <= snap.total and snap.peak > 0


def test_cuda_memory_reader_counts_torch_cached_blocks_as_free(monkeypatch):
    """``mem_get_info`` does not see blocks torch caches but no tensor uses (a previous
    engine's in this process): they are this process's to reuse, so they count as free."""
    from bladellm.platforms.cuda import CudaMemoryReader

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 20 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 31 * gib)
    snap = CudaMemoryReader(torch.device("cuda", 0)).snapshot()
    assert snap.total == 80 * gib and snap.free == 28 * gib
    # The peak in reserved bytes (what the device gave torch), the allocations as they are.
    assert snap.peak == 31 * gib and snap.torch_allocated == 12 * gib


def test_worker_logs_its_platform_and_runs_on_cpu(tiny_llama, caplog):
    from bladellm.model.loader import resolve_model
    from bladellm.worker.worker import Worker

    cfg = EngineConfig.from_kwargs(model=tiny_llama, dtype="float32", device="auto",
                                   max_model_len=64, num_kv_blocks=8)
    with caplog.at_level(logging.INFO):
        worker = Worker(cfg, resolve_model(cfg.model, device=cfg.device))
    assert worker.platform.name == "cpu" and worker.device == torch.device("cpu")
    assert "worker 0 on cpu (" in caplog.text and "--device auto" in caplog.text
