"""The CUDA platform (NVIDIA GPUs; ROCm builds of torch expose AMD GPUs through the same
``torch.cuda`` API): NCCL, the Triton kernels, ``--dtype auto`` keeps a 16-bit checkpoint's dtype,
pinned host buffers, and the KV cache sized by a profiling forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bladellm.platforms.interface import CopyFence, MemoryReader, MemorySnapshot, Platform

if TYPE_CHECKING:
    import torch

GiB = 1 << 30


class CudaMemoryReader(MemoryReader):
    """One GPU's memory through torch: ``mem_get_info`` (the driver's free / total, other
    processes counted) and the caching allocator's peak. Blocks torch has cached but does not
    use (``memory_reserved - memory_allocated``) count as free: this process can reuse them
    (a previous engine's, after its shutdown, until ``release_cached``)."""

    def __init__(self, device: "torch.device") -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        cached = torch.cuda.memory_reserved(self.device) - allocated
        # The peak in reserved bytes, not allocated ones: the device gave the allocator all of
        # them, fragmentation included (vLLM's profile reads the same).
        return MemorySnapshot(total=total, free=min(total, free + max(0, cached)),
                              peak=torch.cuda.max_memory_reserved(self.device),
                              torch_allocated=allocated)

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        import torch

        torch.cuda.empty_cache()


class CudaCopyFence(CopyFence):
    """A CUDA event on the device's current stream (re-recorded each time)."""

    def __init__(self, device: "torch.device") -> None:
        self.device = device
        self._event = None

    def record(self) -> None:
        import torch

        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class CudaPlatform(Platform):
    name = "cuda"
    dist_backend = "nccl"
    auto_kernel_set = "triton"
    sizes_kv_cache_by_profiling = True
    # Not built on a GPU yet (docs/gpu.md): the draft steps build host tensors, and the adapter
    # slots are host buffers.
    supports_speculative_decoding = False
    supports_lora = False

    def device(self, local_rank: int = 0) -> "torch.device":
        import torch

        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"--device cuda: rank {local_rank} on this machine needs GPU "
                             f"{local_rank}, but {count} GPU(s) are visible; lower "
                             f"--tensor_parallel_size x --pipeline_parallel_size or set "
                             f"CUDA_VISIBLE_DEVICES")
        return torch.device("cuda", local_rank)

    def auto_dtype(self, checkpoint_dtype: str | None) -> tuple[str, str]:
        if checkpoint_dtype in ("bfloat16", "float16"):
            return checkpoint_dtype, f"checkpoint {checkpoint_dtype}"
        # As vLLM does on GPUs: float32 would halve the matrix units' rate and double the bytes
        # every decode step reads; --dtype float32 keeps it.
        return "bfloat16", (f"checkpoint {checkpoint_dtype or 'dtype not stated'} served in "
                            f"bfloat16 on cuda; --dtype float32 keeps float32")

    @property
    def supports_pinned_memory(self) -> bool:
        return True

    def memory_reader(self, device: "torch.device") -> MemoryReader:
        return CudaMemoryReader(device)

    def synchronize(self, device: "torch.device") -> None:
        import torch

        torch.cuda.synchronize(device)

    def copy_fence(self, device: "torch.device") -> CopyFence:
        return CudaCopyFence(device)

    def set_device(self, device: "torch.device") -> None:
        import torch

        torch.cuda.set_device(device)

    def describe(self, device: "torch.device") -> str:
        import torch

        props = torch.cuda.get_device_properties(device)
        runtime = (f"HIP {torch.version.hip}" if getattr(torch.version, "hip", None)
                   else f"CUDA {torch.version.cuda}")
        return (f"{device} ({props.name}, {props.total_memory / GiB:.1f} GiB, "
                f"{props.multi_processor_count} SMs; torch {torch.__version__}, {runtime})")
