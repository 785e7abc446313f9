"""The only place BladeLLM reads environment variables.

Behaviour belongs in validated config fields; a variable here is for what must be decided
before any config exists (process-wide caches, escape hatches for debugging). Each one is read by
a function at the moment it is needed, so tests can set it with ``monkeypatch.setenv``.

- ``BLADELLM_CACHE_DIR`` (a directory, default ``~/.cache/bladellm``): compiled kernels and
  other build artifacts.
- ``BLADELLM_GGUF_CACHE`` (``1`` | ``0``, default ``1``): keep a dense Hugging Face copy of each
  served GGUF file so the next start skips parsing and dequantizing it
  (``checkpoint/gguf_cache.py``); ``0`` always reads the GGUF file.
- ``BLADELLM_GGUF_CACHE_DIR`` (a directory, default ``BLADELLM_CACHE_DIR/gguf``): where those
  copies are kept.
- ``BLADELLM_RESOLUTION_CACHE`` (``1`` | ``0``, default ``1``): remember the config transformers
  builds for a model directory and the tokenizer class ``AutoTokenizer`` picks, so later starts
  skip most of transformers' imports (``checkpoint/resolution_cache.py``); ``0`` asks transformers
  every time.
- ``BLADELLM_RESOLUTION_CACHE_DIR`` (a directory, default ``BLADELLM_CACHE_DIR/resolved``): where
  those entries are kept.
- ``TRITON_INTERPRET`` (Triton's own switch, ``1`` = on): Triton kernels run in its interpreter,
  the only way they run on a CPU (tests); read here so that the engine's checks agree with it.
- ``HF_HUB_OFFLINE`` (huggingface_hub's own switch): ``--model org/name`` uses only the local
  hub cache and never reaches the network.
- OpenMP's own ``OMP_NUM_THREADS`` (the engine's thread count when ``--num_threads`` is not
  given) and ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` / ``KMP_BLOCKTIME`` (a user's choice is
  kept; otherwise the engine process gets ``GOMP_SPINCOUNT=1000`` and ``KMP_BLOCKTIME=0``, see
  ``platforms/threads.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir() -> Path:
    """``BLADELLM_CACHE_DIR``: where build artifacts are kept (created on first use)."""
    value = os.environ.get("BLADELLM_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "bladellm"


def gguf_cache_enabled() -> bool:
    """``BLADELLM_GGUF_CACHE``: whether served GGUF files are converted once and cached."""
    value = os.environ.get("BLADELLM_GGUF_CACHE", "1").strip().lower() or "1"
    if value not in ("0", "1", "true", "false"):
        raise ValueError(f"BLADELLM_GGUF_CACHE={value!r} is not one of 0, 1")
    return value in ("1", "true")


def resolution_cache_enabled() -> bool:
    """``BLADELLM_RESOLUTION_CACHE``: whether resolved configs and tokenizer classes are
    remembered across starts."""
    value = os.environ.get("BLADELLM_RESOLUTION_CACHE", "1").strip().lower() or "1"
    if value not in ("0", "1", "true", "false"):
        raise ValueError(f"BLADELLM_RESOLUTION_CACHE={value!r} is not one of 0, 1")
    return value in ("1", "true")


def resolution_cache_dir() -> Path:
    """``BLADELLM_RESOLUTION_CACHE_DIR``: where remembered configs and tokenizer classes are."""
    value = os.environ.get("BLADELLM_RESOLUTION_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else cache_dir() / "resolved"


def gguf_cache_dir() -> Path:
    """``BLADELLM_GGUF_CACHE_DIR``: where dense copies of GGUF files are kept."""
    value = os.environ.get("BLADELLM_GGUF_CACHE_DIR", "").strip()
    return Path(value).expanduser() if value else cache_dir() / "gguf"


OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def omp_num_threads(env: Mapping[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` when it is a positive integer, else None."""
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def omp_wait_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP wait settings the user chose (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``,
    ``KMP_BLOCKTIME``)."""
    env = os.environ if env is None else env
    return {k: env[k] for k in OMP_WAIT_VARS if k in env}


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: whether Triton kernels run in Triton's interpreter (on a CPU)."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def hf_hub_offline() -> bool:
    """``HF_HUB_OFFLINE``: huggingface_hub's switch, read here so that the cache-only lookup and
    the error message agree with it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
