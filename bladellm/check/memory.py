"""Does ``--model`` fit: what the server's ranks on this machine load (weights, their prepacked
copies, an sps draft) plus the KV pool the same flags give them, against the memory this
process may use now.

Every number comes from the engine's own functions on the engine's own model built on the meta
device (nothing is loaded), so the check and the server cannot drift: ``build_model`` and
``model_weight_bytes`` for what the loader allocates (a quantized checkpoint's packed tensors
as stored, each rank's shard under TP/PP), ``prepack_bound`` for the kernels' load-time copies,
``rank_num_blocks`` for the pool.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bladellm.check.result import FAILED, PASS, WARNING, CheckResult
from bladellm.config import EngineConfig
from bladellm.platforms.cpu_defaults import (GiB, KVCacheSizeError, cgroup_memory_limit,
                                             total_memory_bytes)

if TYPE_CHECKING:

    from bladellm.checkpoint.locate import ResolvedModel
    from bladellm.kernels.interface import Kernels

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


@dataclass(frozen=True)
class RankMemory:
    """What one rank allocates besides its KV pool, and that pool's bytes per block."""

    weights: int  # the target's parameters and buffers as loaded (``model_weight_bytes``)
    packed: int  # the kernels' load-time weight copies, at their bound (0: the runner makes none)
    draft: int  # the sps draft's parameters and buffers (0 without one)
    bytes_per_block: int  # target + draft: one block id holds both models' KV

    @property
    def loaded(self) -> int:
        """What the worker counts against the pool (``Worker.determine_num_blocks``)."""
        return self.weights + self.packed + self.draft


def meta_model(resolved: ResolvedModel, attn_cls: str | None, kernels: Kernels,
               attn_flag: str = "--attn_cls") -> Any:
    """``resolved``'s engine model as this process's parallel groups shape it, on the meta
    device, built with the kernel set the worker would resolve (``kernels``): the loader's
    parameters (quantized ones in the checkpoint's packed layout, the rest at the resolved
    dtype) and buffers, with no memory behind them."""
    from bladellm.attention import get_attn_backend
    from bladellm.kernels.scope import building_with
    from bladellm.model.loader import build_model
    from bladellm.quantization import get_quant_config

    # A .gguf read directly is dequantized into a dense model (ResolvedModel.load_model).
    quant = None if resolved.gguf is not None else get_quant_config(
        resolved.hf_config, resolved.model_config.quantization)
    attn_backend = get_attn_backend(attn_cls, kernels, attn_flag)
    with building_with(kernels):
        return build_model(resolved.hf_config, resolved.dtype, "meta", attn_backend,
                           resolved.max_model_len, quant)


def rank_memory(config: EngineConfig, target: ResolvedModel,
                draft: ResolvedModel | None) -> RankMemory:
    """One rank's ``RankMemory``; under TP/PP, call it inside ``tp_shape_for_split``."""
    import torch

    from bladellm.attention.kv_cache import kv_bytes_per_block
    from bladellm.kernels import resolve_kernels
    from bladellm.platforms.cpu_defaults import model_weight_bytes
    from bladellm.worker.model_runner import packable_modules, prepack_bound

    from bladellm.platforms.select import resolve_platform

    device = resolve_platform(config.device).device()  # --device auto resolved as a worker does
    cache = config.cache
    # The worker's choice (Worker.__init__), so the prepacked copies are counted for its set.
    kernels = resolve_kernels(config.model.kernels, device,
                              (config.model.attn_cls, config.draft.attn_cls))
    model = meta_model(target, config.model.attn_cls, kernels)
    if config.lora.enable_lora:  # the runner's device slots: buffers of every adapted linear
        from bladellm.lora.adapter import BaseShapes
        from bladellm.lora.layers import wrap_model

        lora = config.lora
        dtype = target.dtype if lora.lora_dtype == "auto" else getattr(torch, lora.lora_dtype)
        layout = BaseShapes.from_hf_config(target.hf_config).layout
        with torch.device("meta"):
            wrap_model(model, layout, lora.max_loras, lora.max_lora_rank, dtype)
    weights = model_weight_bytes(model)
    # packed_bytes_bound reads a weight's shape, dtype, device and layout only, and is 0 off the
    # CPU: give it empty stand-ins on the server's device kind, one at a time (the generator),
    # whose pages are never touched, so no memory is committed.
    probe_device = "cpu" if device.type == "cpu" else "meta"
    probes = (torch.empty(m.weight.shape, dtype=m.weight.dtype, device=probe_device)
              for m in packable_modules(model))
    packed, made = prepack_bound(probes, weights, kernels)
    spec = model.get_kv_cache_spec()
    # Hybrid KV cache groups (core/kv_groups.py): a block id holds one layer of each group's
    # run, as ModelRunner.bytes_per_block counts it.
    groups = _kv_cache_groups(config, target)
    num_slots = spec.num_layers if groups.num_groups == 1 else min(groups.num_slots,
                                                                   spec.num_layers)
    per_block = kv_bytes_per_block(num_slots, cache.block_size, spec.num_kv_heads,
                                   spec.head_dim, target.dtype, cache.kv_cache_quant)
    draft_bytes = 0
    if draft is not None:  # DraftModelProposer: no prepacked copies, KV stored as the target's
        dm = meta_model(draft, config.draft.attn_cls, kernels, "--draft.attn_cls")
        draft_bytes = model_weight_bytes(dm)
        ds = dm.get_kv_cache_spec()
        per_block += kv_bytes_per_block(ds.num_layers, cache.block_size, ds.num_kv_heads,
                                        ds.head_dim, draft.dtype, cache.kv_cache_quant)
    return RankMemory(weights, packed if made else 0, draft_bytes, per_block)


def _kv_cache_groups(config: EngineConfig, target: ResolvedModel):
    from bladellm.checkpoint.attention_layout import layer_windows
    from bladellm.core.kv_groups import engine_kv_cache_groups

    return engine_kv_cache_groups(layer_windows(target.hf_config),
                                  config.cache.disable_hybrid_kv_cache,
                                  config.speculative.decode_algo)


def _resolve_draft(config: EngineConfig, target: ResolvedModel) -> ResolvedModel | None:
    """The sps draft as ``DraftModelProposer`` resolves it (and refuses it), else None."""
    if config.speculative.decode_algo != "sps":
        return None
    from bladellm.model.loader import resolve_model
    from bladellm.spec_decode.draft_model import check_draft_vocab, draft_model_config

    draft = resolve_model(draft_model_config(config, target.max_model_len, target.dtype), snapshot_config=True)
    check_draft_vocab(target.hf_config, draft.hf_config, draft.path)
    return draft


def all_rank_memory(config: EngineConfig) -> tuple[ResolvedModel, list[RankMemory]]:
    """The resolved target and every rank's ``RankMemory``, in rank order."""
    from bladellm.distributed.parallel_state import tp_shape_for_split
    from bladellm.model.loader import resolve_model

    target = resolve_model(config.model, device=config.device)
    draft = _resolve_draft(config, target)
    par = config.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if par.world_size > 1:  # the multi-process executor's refusals, before any rank starts
        from bladellm.model.parallel_fit import check_pipeline_parallel, check_tensor_parallel

        check_tensor_parallel(target.hf_config, tp,
                              None if target.gguf is not None else target.path, pp)
        check_pipeline_parallel(target.hf_config, pp)
    ranks = []
    for rank in range(par.world_size):  # rank = pp_rank * tp + tp_rank; shards may be uneven
        shape = (tp_shape_for_split(rank % tp, tp, rank // tp, pp) if par.world_size > 1
                 else contextlib.nullcontext())
        with shape:
            ranks.append(rank_memory(config, target, draft))
    return target, ranks


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / (1 << 20):.1f} MiB"


def model_memory(config: EngineConfig) -> tuple[int, int, str]:
    """(bytes loaded, KV-cache bytes, description) of the server's ranks on this machine for
    ``config``, without loading weights. Loaded: the weights, their prepacked copies and an sps
    draft's weights; the KV pool: the engine's block count (the smallest any rank can hold) times
    each local rank's bytes per block."""
    from bladellm.worker.worker import rank_num_blocks

    target, ranks = all_rank_memory(config)
    par = config.parallel
    local = ranks[par.node_rank * par.ranks_per_node:(par.node_rank + 1) * par.ranks_per_node]
    # EngineCore: every rank allocates the same number of blocks, the least any rank can hold.
    # A request holds a block id per KV cache group (ModelRunner.max_blocks_per_request).
    bs = config.cache.block_size
    max_len = _kv_cache_groups(config, target).num_groups * -(-target.max_model_len // bs) * bs
    blocks = min(rank_num_blocks(config, r.bytes_per_block, r.loaded, max_len,
                                 par.ranks_per_node) for r in ranks)
    loaded = sum(r.loaded for r in local)
    kv = sum(blocks * r.bytes_per_block for r in local)
    desc = (f"{target.architecture} {str(target.dtype).removeprefix('torch.')}, "
            f"max_model_len {target.max_model_len}, {blocks} KV blocks of "
            f"{config.cache.block_size} tokens")
    packed, draft = sum(r.packed for r in local), sum(r.draft for r in local)
    if packed:
        desc += f"; weights include {_size(packed)} of prepacked copies (at most)"
    if draft:
        desc += f"; draft {config.draft.model} {_size(draft)}, its KV in every block"
    if len(local) > 1:
        big = max(local, key=lambda r: r.loaded + blocks * r.bytes_per_block)
        desc += (f"; {len(local)} ranks here (TP {par.tensor_parallel_size} x PP "
                 f"{par.pipeline_parallel_size}), the largest {_size(big.loaded)} + KV "
                 f"{_size(blocks * big.bytes_per_block)}")
    return loaded, kv, desc


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
