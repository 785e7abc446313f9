"""CPU defaults that fit the machine: ``--dtype auto`` and ``--kv_cache_memory auto``.

Each decision is a pure function of what was read from the machine (a ``CpuInfo``, a memory
size), so tests fake the machine instead of patching it. docs/cpu.md has the measurements.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from bladellm.platforms.cpu import CGROUP_ROOT, CpuInfo, cgroup_dirs, read_text

GiB = 1 << 30

# ---- --dtype auto --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # float32, bfloat16 or float16
    reason: str  # for the log line: "dtype auto: bfloat16 (<reason>)"
    warning: str | None = None  # an explicit --dtype that will be slow here


def choose_cpu_dtype(requested: str, checkpoint_dtype: str | None, cpu: CpuInfo) -> DtypeChoice:
    """``--dtype`` on a CPU. ``auto`` serves in bfloat16 where the CPU computes bf16 natively
    (AVX512_BF16 or AMX), whatever the checkpoint's dtype, as vLLM's CPU build does; elsewhere
    bf16 is widened to float32 (oneDNN's emulated GEMMs are several times slower than float32,
    the compiled AVX2 kernels about even with it), so every checkpoint loads in float32, which
    also gives transformers' float32 results. An explicit ``--dtype`` always wins, with a
    warning where it is slow."""
    native = ("amx_bf16" if cpu.has_amx else "avx512_bf16") if cpu.has_native_bf16 else None
    if requested != "auto":
        warning = None
        if requested == "bfloat16" and native is None:
            warning = ("--dtype bfloat16 on a CPU without native bf16 (no AVX512_BF16 or AMX): "
                       "every bf16 product is widened to float32. The compiled AVX2 kernels "
                       "run that at float32 speed or better, but oneDNN's and torch's emulated "
                       "bf16 GEMMs (other ISAs, or --kernels ref) are several times "
                       "slower than float32; --dtype auto picks float32 here (docs/cpu.md)")
        elif requested == "float16":
            warning = ("float16 on CPU is slow and overflow-prone; --dtype bfloat16 is "
                       "recommended")
        return DtypeChoice(requested, f"--dtype {requested}", warning)
    if checkpoint_dtype not in ("bfloat16", "float16"):
        stated = checkpoint_dtype or "dtype not stated"
        if native is not None:
            # vLLM's auto does the same on such CPUs: bf16 halves the bytes every decode step
            # streams, and native bf16 dot products keep it at full speed (docs/cpu.md has the
            # measured gain). --dtype float32 keeps the checkpoint's precision.
            return DtypeChoice("bfloat16", f"checkpoint {stated}, CPU has {native}; "
                                           "--dtype float32 keeps float32")
        return DtypeChoice("float32", f"checkpoint {stated}")
    if native is not None:
        return DtypeChoice("bfloat16", f"checkpoint {checkpoint_dtype}, CPU has {native}")
    return DtypeChoice("float32", f"checkpoint {checkpoint_dtype}, CPU has no native bf16 "
                                  f"(AVX512_BF16 or AMX), where float32 is faster")


# ---- --kv_cache_memory auto ----------------------------------------------------------------------

# The KV cache takes this share of the memory the weights leave, at most KV_CACHE_AUTO_MAX.
KV_CACHE_AUTO_FRACTION = 0.25
KV_CACHE_AUTO_MAX = 8 * GiB


def auto_kv_cache_bytes(total_memory_bytes: int, weight_bytes: int) -> int:
    """KV-cache bytes for ``--kv_cache_memory auto``: a quarter of (total memory - weights),
    at most 8 GiB. It depends only on the machine and the model, never on what else happens to
    be running, so the pool is the same size on every start. The worker still cuts it to what
    ``--max_num_seqs`` full-length requests can use."""
    spare = max(0, total_memory_bytes - weight_bytes)
    return min(int(spare * KV_CACHE_AUTO_FRACTION), KV_CACHE_AUTO_MAX)


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 16 * GiB  # no sysconf (not Linux): assume a modest machine


def cgroup_memory_limit(root: str = CGROUP_ROOT, self_cgroup: str | None = None) -> int | None:
    """The smallest memory limit over this process's cgroup and its ancestors (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``); None when unlimited."""
    limits = []
    for d in cgroup_dirs("memory", root, self_cgroup):
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = read_text(os.path.join(d, name))
            if value is not None and value.isdigit():
                limits.append(int(value))  # v1's "unlimited" is a huge number: min() drops it
    return min(limits) if limits else None


def total_memory_bytes(root: str = CGROUP_ROOT, self_cgroup: str | None = None) -> int:
    """Memory this process may use: physical memory, or the cgroup limit if lower."""
    limit = cgroup_memory_limit(root, self_cgroup)
    physical = physical_memory_bytes()
    return physical if limit is None else min(physical, limit)


def model_weight_bytes(model: Any) -> int:
    """Bytes of a ``torch.nn.Module``'s parameters and buffers (tied weights counted once),
    plus what its modules hold outside tensors (``opaque_weight_bytes``: fbgemm's packed int8
    weights)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    opaque = sum(getattr(m, "opaque_weight_bytes", 0) for m in model.modules())
    return sum(t.numel() * t.element_size() for t in tensors) + opaque


class KVCacheSizeError(ValueError):
    """An explicit ``--num_kv_blocks`` / ``--kv_cache_memory`` that this machine cannot hold."""


def kv_cache_num_blocks(num_kv_blocks: int | None, kv_cache_bytes: int | None,
                        bytes_per_block: int,
                        max_num_seqs: int, max_model_len: int, block_size: int,
                        weight_bytes: int, total_memory: int) -> int:
    """KV blocks a CPU rank allocates: ``--num_kv_blocks``, ``--kv_cache_memory SIZE``
    (``kv_cache_bytes``), or auto (``kv_cache_bytes`` None: ``auto_kv_cache_bytes``, never more
    than ``--max_num_seqs`` full-length requests can use, +1 for the null block). The worker and
    ``blade_llm_check`` both size the pool with it."""
    if num_kv_blocks is not None or kv_cache_bytes is not None:
        flag = "--num_kv_blocks" if num_kv_blocks is not None else "--kv_cache_memory"
        blocks = (num_kv_blocks if num_kv_blocks is not None
                  else max(2, kv_cache_bytes // bytes_per_block))
        # An explicit size past the machine would fail at allocation with torch's bare
        # RuntimeError (or, overcommitted, swap the machine to a halt once the pool fills).
        if blocks * bytes_per_block + weight_bytes > total_memory:
            raise KVCacheSizeError(
                f"{flag}: {blocks} KV blocks take {blocks * bytes_per_block / GiB:.2f} GiB, "
                f"which with the weights' {weight_bytes / GiB:.2f} GiB exceeds this rank's "
                f"{total_memory / GiB:.2f} GiB of memory")
        return blocks
    usable = max_num_seqs * -(-max_model_len // block_size)
    budget = auto_kv_cache_bytes(total_memory, weight_bytes)
    return max(2, min(budget // bytes_per_block, usable + 1))
