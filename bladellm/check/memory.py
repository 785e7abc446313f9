"""Does ``--model`` fit: its weights at the resolved dtype plus the KV cache the same flags give
the server, against the memory this process may use now."""

from __future__ import annotations

import re

from bladellm.attention.kv_cache import kv_bytes_per_block
from bladellm.check.result import FAILED, PASS, WARNING, CheckResult
from bladellm.config import EngineConfig, parse_size
from bladellm.platforms.cpu_defaults import (GiB, KVCacheSizeError, cgroup_memory_limit,
                                             kv_cache_num_blocks, total_memory_bytes)

TIGHT_FRACTION = 0.9  # needing more than this share of what is available is a warning


def available_memory_bytes(meminfo: str | None = None) -> int:
    """MemAvailable (what can be allocated without swapping), cut to the cgroup's limit."""
    if meminfo is None:
        try:
            with open("/proc/meminfo", encoding="utf-8") as f:
                meminfo = f.read()
        except OSError:
            meminfo = ""
    m = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M)
    available = int(m.group(1)) * 1024 if m else total_memory_bytes()
    limit = cgroup_memory_limit()
    return available if limit is None else min(available, limit)


def model_memory(config: EngineConfig) -> tuple[int, int, str]:
    """(weight bytes, KV-cache bytes, description) for ``config`` without loading weights: the
    architecture is built on the meta device to count parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    from bladellm.model.checkpoint import resolve_model

    resolved = resolve_model(config.model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(resolved.hf_config)
    elem = torch.tensor([], dtype=resolved.dtype).element_size()
    weights = sum(p.numel() for p in meta.parameters()) * elem
    hf = resolved.hf_config
    text = getattr(hf, "text_config", None) or hf
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    cache = config.cache
    per_block = kv_bytes_per_block(text.num_hidden_layers, cache.block_size, kv_heads,
                                   head_dim, resolved.dtype, cache.kv_cache_quant)
    kv_bytes = None if cache.kv_cache_memory == "auto" else parse_size(cache.kv_cache_memory)
    blocks = kv_cache_num_blocks(cache.num_kv_blocks, kv_bytes, per_block,
                                 config.scheduler.max_num_seqs, resolved.max_model_len,
                                 cache.block_size, weights, total_memory_bytes())
    desc = (f"{resolved.architecture} {str(resolved.dtype).removeprefix('torch.')}, "
            f"max_model_len {resolved.max_model_len}, {blocks} KV blocks of {cache.block_size} "
            f"tokens")
    return weights, blocks * per_block, desc


def check_memory(config: EngineConfig, available: int | None = None) -> CheckResult:
    try:
        weights, kv, desc = model_memory(config)
    except KVCacheSizeError as exc:
        return CheckResult("memory", FAILED, str(exc))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        return CheckResult("memory", FAILED, f"cannot read --model {config.model.model!r}: "
                                             f"{type(exc).__name__}: {exc}")
    available = available_memory_bytes() if available is None else available
    need = weights + kv
    detail = (f"needs {need / GiB:.2f} GiB (weights {weights / GiB:.2f} GiB + KV cache "
              f"{kv / GiB:.2f} GiB; {desc}), {available / GiB:.2f} GiB available")
    if need > available:
        return CheckResult("memory", FAILED, detail + ": lower --kv_cache_memory, "
                                                      "--max_model_len or --max_num_seqs")
    if need > TIGHT_FRACTION * available:
        return CheckResult("memory", WARNING, detail + ": little room left")
    return CheckResult("memory", PASS, detail)
