"""CPU kernels: compiled C++ for this machine's ISA, or their plain-PyTorch twins (``ref.py``).

The choice is made once per process by ``get_kernels()`` and logged in one line:
``BLADELLM_KERNELS=ref`` forces the reference; otherwise the kernels are compiled on first use
into ``BLADELLM_CACHE_DIR`` (a later start loads the cached library in milliseconds), and if
that is impossible (no compiler, a build error) one warning is logged and the reference is used.
``BLADELLM_KERNELS=triton`` selects the Triton set (``triton_set.py``: GPU, or the interpreter).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from bladellm import envs
from bladellm.kernels.build import BuildError, build_library
from bladellm.kernels.interface import Kernels
from bladellm.platforms.cpu import detect_cpu

logger = logging.getLogger(__name__)

__all__ = ["Kernels", "get_kernels", "load_kernels"]


def load_kernels(mode: str | None = None, cache_root: Path | None = None,
                 isa: str | None = None) -> Kernels:
    """Build or load the kernel set (uncached; ``get_kernels`` is the cached entry point).
    Defaults come from ``envs`` and ``detect_cpu``."""
    mode = envs.kernels_mode() if mode is None else mode
    isa = detect_cpu().isa if isa is None else isa
    if mode == "ref":
        logger.info("CPU kernels: reference (BLADELLM_KERNELS=ref; ISA %s)", isa)
        return Kernels()
    if mode == "triton":
        return _triton_kernels()
    root = envs.cache_dir() if cache_root is None else cache_root
    try:
        built = build_library(isa, root)
        from bladellm.kernels.compiled import CompiledKernels

        kernels = CompiledKernels(built.lib, isa)
    except (BuildError, OSError, AttributeError) as e:
        logger.warning("CPU kernels: cannot build the compiled kernels for %s, using the "
                       "plain-PyTorch reference (slower): %s", isa, e)
        return Kernels()
    logger.info("CPU kernels: compiled %s (%s, %.2f s)", isa,
                "cache hit" if built.cache_hit else f"built {built.path.name}", built.seconds)
    return kernels


def _triton_kernels() -> Kernels:
    import os

    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError("BLADELLM_KERNELS=triton: the triton package is not installed") from None
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("BLADELLM_KERNELS=triton: Triton kernels need a CUDA device; on a CPU "
                         "they run only under TRITON_INTERPRET=1 (slow, for tests)")
    from bladellm.kernels.triton_set import TritonKernels

    logger.info("kernels: triton%s", "" if torch.cuda.is_available() else " (interpreter)")
    return TritonKernels()


@functools.lru_cache(maxsize=1)
def get_kernels() -> Kernels:
    """The process's kernel set, chosen on the first call."""
    return load_kernels()
