"""The only place BladeLLM reads environment variables.

Behaviour belongs in validated config fields; a variable here is for what must be decided
before any config exists (process-wide caches, escape hatches for debugging). Each one is read by
a function at the moment it is needed, so tests can set it with ``monkeypatch.setenv``.

- ``BLADELLM_KERNELS`` (``auto`` | ``ref``, default ``auto``): ``ref`` always uses the
  plain-PyTorch kernels and never compiles.
- ``BLADELLM_CACHE_DIR`` (a directory, default ``~/.cache/bladellm``): compiled kernels and
  other build artifacts.
"""

from __future__ import annotations

import os
from pathlib import Path

KERNELS_MODES = ("auto", "ref")


def kernels_mode() -> str:
    """``BLADELLM_KERNELS``: ``auto`` compiles the CPU kernels for this machine's ISA (falling
    back to the reference if that fails), ``ref`` always uses the plain-PyTorch reference."""
    value = os.environ.get("BLADELLM_KERNELS", "auto").strip().lower() or "auto"
    if value not in KERNELS_MODES:
        raise ValueError(f"BLADELLM_KERNELS={value!r} is not one of {', '.join(KERNELS_MODES)}")
    return value


def cache_dir() -> Path:
    """``BLADELLM_CACHE_DIR``: where build artifacts are kept (created on first use)."""
    value = os.environ.get("BLADELLM_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "bladellm"
