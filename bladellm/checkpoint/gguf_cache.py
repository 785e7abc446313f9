"""A dense Hugging Face copy of each served GGUF file, made once, so later starts skip the GGUF.

Reading a GGUF file is slow in Python where it does not need to be: ``gguf.GGUFReader`` builds a
Python object per metadata array element (the demo's 49k-token vocabulary and merges: seconds;
docs/cpu.md), transformers converts its tokenizer, and every tensor is
dequantized with numpy. Both processes pay it (the API process for the tokenizer and config,
the engine core for the weights). The first start therefore writes what it read as a plain model
directory (``config.json``, ``model.safetensors`` at the file's dense dtype, tokenizer files,
``generation_config.json``); later starts load that directory the ordinary way: safetensors are
memory-mapped and the fast tokenizer is read from ``tokenizer.json``.

The copy is exact: weights are stored as dequantized (float32 for block-quantized files), so the
serving dtype's cast happens at load time exactly as on the GGUF path. Entries live in ``BLADELLM_GGUF_CACHE_DIR``
(default ``~/.cache/bladellm/gguf``); an entry is keyed by the
file's real path, size and mtime and this converter's version; an entry whose source changed or
vanished is removed the next time an entry is written. ``BLADELLM_GGUF_CACHE=0`` turns it off; a
file whose dense copy would not fit on the disk with room to spare is served from the GGUF as
before, with one log line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from bladellm import envs

logger = logging.getLogger(__name__)

# Bump when the conversion's output changes (names, dtypes, tokenizer handling).
CONVERTER_VERSION = 1
_SOURCE_FILE = "bladellm_gguf_source.json"
_DISK_HEADROOM_BYTES = 1 << 30


def cache_root() -> Path:
    return envs.gguf_cache_dir()


def _source_stamp(gguf_path: str) -> dict:
    st = os.stat(gguf_path)
    return {"path": os.path.realpath(gguf_path), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "converter": CONVERTER_VERSION}


def entry_dir(gguf_path: str) -> Path:
    """Where the dense copy of ``gguf_path`` lives (whether or not it exists yet)."""
    stamp = _source_stamp(gguf_path)
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"{Path(gguf_path).stem}-{key}"


def lookup(gguf_path: str) -> str | None:
    """The cached model directory for ``gguf_path`` if it is complete, else None (no GGUF read)."""
    if not envs.gguf_cache_enabled():
        return None
    entry = entry_dir(gguf_path)
    return str(entry) if (entry / _SOURCE_FILE).is_file() else None


def convert(ckpt) -> str | None:
    """Write the dense copy of an open ``GGUFCheckpoint``; returns its directory, or None when
    caching is off or the copy does not fit on the disk. Safe against a second process doing the
    same (the API process and the engine core both resolve the model): one converts under a lock,
    the other finds the finished entry."""
    from bladellm.checkpoint.gguf import write_hf_dir

    if not envs.gguf_cache_enabled():
        return None
    entry = entry_dir(ckpt.path)
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (entry / _SOURCE_FILE).is_file():
            return str(entry)
        need = dense_bytes(ckpt)
        free = shutil.disk_usage(root).free
        if free < 2 * need + _DISK_HEADROOM_BYTES:
            logger.info("not caching a dense copy of %s: %.1f GiB needed, %.1f GiB free in %s",
                        ckpt.path, need / 2**30, free / 2**30, root)
            return None
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=root))
        try:
            write_hf_dir(ckpt, tmp)
            (tmp / _SOURCE_FILE).write_text(json.dumps(_source_stamp(ckpt.path), indent=2) + "\n")
            os.replace(tmp, entry)  # atomic: readers see a complete entry or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("cached a dense copy of %s in %s (%.0f MiB; BLADELLM_GGUF_CACHE=0 turns "
                    "this off)", ckpt.path, entry, need / 2**20)
    prune_stale()
    return str(entry)


def dense_bytes(ckpt) -> int:
    """Size of the dense copy: every tensor at 4 bytes per value unless the file stores it at 2."""
    total = 0
    for tensor in ckpt.tensors.values():
        width = 2 if tensor.tensor_type.name in ("F16", "BF16") else 4
        total += int(tensor.n_elements) * width
    return total


def prune_stale() -> list[Path]:
    """Remove entries whose source file changed or no longer exists; returns what was removed."""
    removed = []
    root = cache_root()
    if not root.is_dir():
        return removed
    for source in root.glob(f"*/{_SOURCE_FILE}"):
        entry = source.parent
        try:
            stamp = json.loads(source.read_text())
            current = _source_stamp(stamp["path"])
        except (OSError, ValueError, KeyError, TypeError):
            current = None
            stamp = {}
        if current != stamp:
            shutil.rmtree(entry, ignore_errors=True)
            lock = root / f"{entry.name}.lock"
            lock.unlink(missing_ok=True)
            removed.append(entry)
    return removed
