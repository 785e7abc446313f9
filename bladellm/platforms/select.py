"""``--device``: auto, cpu or cuda, resolved to a ``Platform`` once at start-up."""

from __future__ import annotations

from collections.abc import Callable

from bladellm.platforms.interface import Platform

DEVICES = ("auto", "cpu", "cuda")  # bladellm.config keeps the same tuple


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_platform(device: str,
                     cuda_available: Callable[[], bool] = _cuda_available) -> Platform:
    """The platform for ``--device device``: ``auto`` is cuda when torch sees a GPU, else cpu;
    an explicit ``cuda`` without one is a ValueError naming the flag. Deterministic for a given
    machine, so the engine (``--dtype auto``) and every worker resolve the same platform."""
    if device not in DEVICES:
        raise ValueError(f"--device: must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda":
        if not cuda_available():
            raise ValueError("--device cuda: torch sees no CUDA device (a CPU-only torch build, "
                             "no driver, or CUDA_VISIBLE_DEVICES empty); install a CUDA build of "
                             "torch (docs/gpu.md) or pass --device cpu")
        from bladellm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from bladellm.platforms.cpu_platform import CpuPlatform

    return CpuPlatform()


def platform_of(device: "str | object") -> Platform:
    """The platform of an already chosen torch device (``torch.device`` or its string)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        from bladellm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    if kind == "cpu":
        from bladellm.platforms.cpu_platform import CpuPlatform

        return CpuPlatform()
    raise ValueError(f"no platform for device {device!r}")
