"""The CPU platform: gloo, the compiled CPU kernels, ``--dtype auto`` by the CPU's bf16 support,
the KV cache sized by ``--kv_cache_memory`` (``cpu_defaults.py``)."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

from bladellm.platforms.cpu import detect_cpu, read_text
from bladellm.platforms.cpu_defaults import choose_cpu_dtype, total_memory_bytes
from bladellm.platforms.interface import MemoryReader, MemorySnapshot, Platform

if TYPE_CHECKING:
    import torch


def mem_available_bytes(meminfo: str | None) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` text, in bytes (None if absent)."""
    for line in (meminfo or "").splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * 1024
    return None


class CpuMemoryReader(MemoryReader):
    """Process memory: the total this process may use, what the machine has available, and the
    peak resident set (the kernel's high-water mark; it cannot be reset, so ``reset_peak`` is a
    no-op and the peak covers the whole process)."""

    def snapshot(self) -> MemorySnapshot:
        total = total_memory_bytes()
        free = mem_available_bytes(read_text("/proc/meminfo"))
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return MemorySnapshot(total=total, free=total if free is None else min(free, total),
                              peak=peak_kib * 1024)

    def reset_peak(self) -> None:
        pass


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    auto_kernel_set = "compiled"
    sizes_kv_cache_by_profiling = False
    supports_speculative_decoding = True
    supports_lora = True

    def device(self, local_rank: int = 0) -> "torch.device":
        import torch

        return torch.device("cpu")

    def auto_dtype(self, checkpoint_dtype: str | None) -> tuple[str, str]:
        choice = choose_cpu_dtype("auto", checkpoint_dtype, detect_cpu())
        return choice.dtype, choice.reason

    @property
    def supports_pinned_memory(self) -> bool:
        # Nothing is copied to another device: the step's host buffers are the model's inputs.
        return False

    def memory_reader(self, device: "torch.device") -> MemoryReader:
        return CpuMemoryReader()

    def synchronize(self, device: "torch.device") -> None:
        pass  # CPU ops run synchronously

    def describe(self, device: "torch.device") -> str:
        return f"cpu ({detect_cpu().describe()})"
