"""The device the engine runs on, as one object chosen once at start-up.

Everything that differs between a CPU and a GPU worker lives behind ``Platform``: the torch
device of a rank, the ``torch.distributed`` backend, what ``--dtype auto`` means, which kernel
set ``--kernels auto`` takes, whether host buffers can be pinned, how device memory is read and
how the host waits for the device. The executor, worker, runner, persistent batch and sampler
are one code path that asks the platform; they hold no ``if device.type == "cuda"`` branches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily: importing the engine must not import torch
    import torch


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory as the platform reads it, in bytes."""

    total: int  # the device's (or, on a CPU, this process's: cgroup limit or physical) memory
    # What the device (machine) has free right now, other processes counted, plus what this
    # process's allocator caches without using (it can hand those out again).
    free: int
    # The most this process's allocator held since the last reset: on a GPU torch's reserved
    # blocks (what the device actually gave it, fragmentation included); on a CPU the resident
    # set.
    peak: int
    # Bytes torch's device allocator has handed out right now (0 where the device has no
    # allocator of its own, a CPU). With ``free`` it separates memory this process took outside
    # torch (CUDA context growth, NCCL buffers, compiled kernels): what ``free`` lost beyond it.
    torch_allocated: int = 0


class MemoryReader(ABC):
    """Reads one device's memory; tests hand the profiler a fake one."""

    @abstractmethod
    def snapshot(self) -> MemorySnapshot: ...

    @abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak window (``peak`` counts from here)."""

    def release_cached(self) -> None:
        """Return cached but unused blocks to the device (a caching allocator's)."""


class CopyFence:
    """A point in a device's work queue the host can wait for: ``record`` marks it (after the
    copies just queued), ``wait`` blocks the host until the device has passed it. On a device
    whose copies finish before they return (the CPU) both are no-ops, as here."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class Platform(ABC):
    """One kind of device. Subclasses are stateless: the choice is made by ``resolve_platform``
    and handed down; nothing reads it from a global."""

    name: str  # "cpu" or "cuda": --device after auto is resolved
    dist_backend: str  # torch.distributed backend for TP collectives and PP send/recv
    auto_kernel_set: str  # what --kernels auto resolves to here ("compiled" or "triton")
    # The KV cache is sized by a profiling forward against --max_gpu_memory_utilization
    # (worker/memory_profile.py); otherwise by --kv_cache_memory (platforms/cpu_defaults.py).
    sizes_kv_cache_by_profiling: bool
    # Features built on this platform so far; the worker refuses the others' flags.
    supports_speculative_decoding: bool
    supports_lora: bool

    @abstractmethod
    def device(self, local_rank: int = 0) -> "torch.device":
        """The torch device of the rank with this index among the ranks on its machine."""

    @abstractmethod
    def auto_dtype(self, checkpoint_dtype: str | None) -> tuple[str, str]:
        """(dtype, reason) for ``--dtype auto`` and a checkpoint of ``checkpoint_dtype``."""

    @property
    @abstractmethod
    def supports_pinned_memory(self) -> bool:
        """Host buffers can be page-locked, so host-to-device copies run asynchronously."""

    @abstractmethod
    def memory_reader(self, device: "torch.device") -> MemoryReader: ...

    @abstractmethod
    def synchronize(self, device: "torch.device") -> None:
        """Wait until the work queued on ``device`` is done (timings, never in a step)."""

    @abstractmethod
    def describe(self, device: "torch.device") -> str:
        """One line for the start-up log: the device, its memory, the runtime."""

    def copy_fence(self, device: "torch.device") -> CopyFence:
        """A fence for host-to-``device`` copies (``worker/device_inputs.py`` waits on it before
        it overwrites the pinned buffer those copies read)."""
        return CopyFence()

    def set_device(self, device: "torch.device") -> None:
        """Make ``device`` this process's current device (before any allocation on it)."""
