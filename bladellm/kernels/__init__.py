"""Kernel sets: compiled C++ for this CPU's ISA, their plain-PyTorch twins (``ref.py``), or the
Triton kernels (``triton_set.py``).

``--kernels`` (``ModelConfig.kernels``) names one. The worker resolves it once, together with
its device (``resolve_kernels``), and hands the set down: to the model's layers at construction
(``scope.building_with``), to the attention backend, the LoRA layers, the grammar bitmask, the
compiled decoder stack and the quantized CPU kernels. Nothing looks a set up process-wide.

- ``auto``: on a CPU the compiled kernels, built on first use into ``BLADELLM_CACHE_DIR`` (a
  later start loads the cached library), or, where that is impossible (no compiler, a build
  error), the reference after one warning; on CUDA, or when ``--attn_cls`` (or
  ``--draft.attn_cls``) is ``triton``, the Triton kernels.
- ``compiled``: the compiled CPU kernels; a failed build is an error naming ``--kernels``.
- ``ref``: the reference; nothing is compiled.
- ``triton``: the Triton kernels (CUDA; on a CPU only under ``TRITON_INTERPRET=1``, for tests).

A CPU set is a pure function of (``--kernels``, ISA, cache directory): each is loaded once per
process and shared (``shared_cpu_kernels``), so a second engine does not hash and load again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from bladellm import envs
from bladellm.kernels.build import BuildError, build_library
from bladellm.kernels.interface import Kernels
from bladellm.platforms.cpu import detect_cpu
from bladellm.platforms.select import platform_of

logger = logging.getLogger(__name__)

__all__ = ["KERNEL_SETS", "Kernels", "load_kernels", "resolve_kernels", "shared_cpu_kernels",
           "triton_kernels"]

KERNEL_SETS = ("auto", "compiled", "ref", "triton")  # bladellm.config keeps the same tuple


def resolve_kernels(mode: str, device: str | torch.device,
                    attn_cls: Iterable[str | None] = ()) -> Kernels:
    """The kernel set ``--kernels mode`` gives a worker on ``device``. ``attn_cls``: the
    attention backends asked for (``--attn_cls``, ``--draft.attn_cls``); ``auto`` resolves to
    the Triton set when one of them is ``triton``. Called once per worker."""
    _check_mode(mode)
    device = torch.device(device)
    if mode == "triton":
        return triton_kernels(device, "--kernels triton")
    if mode == "auto" and "triton" in {(name or "auto").lower() for name in attn_cls}:
        return triton_kernels(device, "--attn_cls triton (with --kernels auto)")
    platform = platform_of(device)  # the device's kernel set for auto (platforms/)
    if platform.auto_kernel_set == "triton":
        if mode == "auto":
            return triton_kernels(device, f"--kernels auto (on {platform.name})")
        if mode == "compiled":
            raise ValueError(f"--kernels compiled: the compiled kernels run on CPUs, this "
                             f"worker runs on {platform.name}; use --kernels auto or triton")
    return shared_cpu_kernels(mode, detect_cpu().isa, str(envs.cache_dir()))


@functools.lru_cache(maxsize=None)
def shared_cpu_kernels(mode: str, isa: str, cache_root: str) -> Kernels:
    """``load_kernels`` once per process for each (mode, ISA, cache directory): a pure build,
    cached; which set a worker uses is still its own choice (``resolve_kernels``)."""
    return load_kernels(mode, Path(cache_root), isa)


def load_kernels(mode: str, cache_root: Path | None = None, isa: str | None = None) -> Kernels:
    """Build or load the CPU kernel set ``mode`` (``auto``, ``compiled`` or ``ref``), uncached.
    ``cache_root`` defaults to ``BLADELLM_CACHE_DIR``, ``isa`` to this machine's."""
    _check_mode(mode)
    if mode == "triton":
        raise ValueError("load_kernels: the Triton set is not a CPU build; use triton_kernels")
    isa = detect_cpu().isa if isa is None else isa
    if mode == "ref":
        logger.info("CPU kernels: reference (--kernels ref; ISA %s)", isa)
        return Kernels()
    root = envs.cache_dir() if cache_root is None else cache_root
    try:
        built = build_library(isa, root)
        from bladellm.kernels.compiled import CompiledKernels

        kernels = CompiledKernels(built.lib, isa, str(root))
    except (BuildError, OSError, AttributeError) as e:
        if mode == "compiled":
            raise ValueError(f"--kernels compiled: cannot build the compiled kernels for {isa} "
                             f"({e}); use --kernels auto or ref") from e
        logger.warning("CPU kernels: cannot build the compiled kernels for %s, using the "
                       "plain-PyTorch reference (slower): %s", isa, e)
        return Kernels()
    logger.info("CPU kernels: compiled %s (%s, %.2f s)", isa,
                "cache hit" if built.cache_hit else f"built {built.path.name}", built.seconds)
    return kernels


def triton_kernels(device: torch.device, flag: str) -> Kernels:
    """The Triton set, refused (a ValueError naming ``flag``) where Triton cannot run: without
    the triton package, or off CUDA unless Triton's interpreter is on (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag}: the triton package is not installed "
                         f"(pip install 'bladellm[gpu]')") from None
    if device.type != "cuda" and not envs.triton_interpret():
        raise ValueError(f"{flag}: Triton kernels need a CUDA device (this engine runs on "
                         f"{device.type}); on a CPU they run only under TRITON_INTERPRET=1 "
                         f"(slow, for tests)")
    from bladellm.kernels.triton_set import TritonKernels

    logger.info("kernels: triton%s", "" if device.type == "cuda" else " (interpreter)")
    return TritonKernels()


def _check_mode(mode: str) -> None:
    if mode not in KERNEL_SETS:
        raise ValueError(f"--kernels: must be one of {', '.join(KERNEL_SETS)}, got {mode!r}")
