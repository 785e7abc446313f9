"""Helpers shared by layers, models and the loader: TP world info, checkpoint routing, KV spec
(weight attributes: ``bladellm.quantization.weight_attrs``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from bladellm.distributed.parallel_state import get_tp_group

logger = logging.getLogger(__name__)


def get_tp_rank_and_size() -> tuple[int, int]:
    """(rank, size) of this process's tensor-parallel group; (0, 1) without one."""
    tp = get_tp_group()
    return tp.rank_in_group, tp.world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (identity at world size 1)."""
    return get_tp_group().all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate shards over the TP group along ``dim`` (identity at world size 1);
    ``sizes``: each rank's extent along ``dim`` when the shards are uneven."""
    return get_tp_group().all_gather(x, dim, sizes)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter slice; a shape mismatch is a ValueError."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(src.shape)}, "
                         f"parameter expects {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: Any = None) -> None:
    """Replicated parameters (norms, biases of row-parallel layers): copy the whole tensor."""
    copy_checked(param.data, loaded_weight)


@dataclass(frozen=True)
class KVCacheSpec:
    """What the worker needs to allocate one ``[2, num_blocks, block_size, kvh, d]`` tensor per
    layer. ``num_kv_heads`` is per TP rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def load_weights_with_mapping(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                              packed_modules_mapping: dict[str, list[str]],
                              skip: Callable[[str], bool] = lambda name: False) -> set[str]:
    """Route HF checkpoint tensors to parameters, fusing the checkpoint modules the model's
    ``packed_modules_mapping`` names (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``):
    each part loads with its index in that list as the shard id.

    Returns the names of the parameters that received data. Tensors matching no parameter are
    skipped with one warning (e.g. stale buffers); missing parameters are the caller's check.
    """
    stacked = [(fused, part, index) for fused, parts in packed_modules_mapping.items()
               for index, part in enumerate(parts)]
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unknown: list[str] = []
    # A fused parameter counts as loaded only once every shard (q, k and v) has arrived.
    expected = {frag: {sid for f, _, sid in stacked if f == frag} for frag, _, _ in stacked}
    shards_seen: dict[str, set[Any]] = {}
    for ckpt_name, tensor in weights:
        if "rotary_emb.inv_freq" in ckpt_name or skip(ckpt_name):
            continue
        name, shard_id = ckpt_name, None
        for param_frag, ckpt_frag, sid in stacked:
            if f".{ckpt_frag}." in ckpt_name:
                name, shard_id = ckpt_name.replace(f".{ckpt_frag}.", f".{param_frag}."), sid
                break
        param = params.get(name)
        if param is None:
            unknown.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} {tuple(tensor.shape)} -> parameter "
                             f"{name!r} {tuple(param.shape)} (its shape from config.json): "
                             f"{e}") from e
        if shard_id is None:
            loaded.add(name)
            continue
        seen = shards_seen.setdefault(name, set())
        seen.add(shard_id)
        frag = next(f for f, _, _ in stacked if f".{f}." in name)
        if seen >= expected[frag]:
            loaded.add(name)
    if unknown:
        logger.warning("ignored %d checkpoint tensors with no matching parameter: %s",
                       len(unknown), ", ".join(unknown[:8]))
    result = LoadedNames(loaded)
    for name in set(shards_seen) - loaded:  # some of a fused parameter's tensors arrived
        frag = next(f for f, _, _ in stacked if f".{f}." in name)
        parts = packed_modules_mapping[frag]
        result.missing_parts[name] = [name.replace(f".{frag}.", f".{parts[sid]}.")
                                      for sid in sorted(expected[frag] - shards_seen[name])]
    return result


class LoadedNames(set):
    """The parameters that received data; ``missing_parts``: for a fused parameter that got
    only some of its checkpoint tensors, the names of those it did not get (the loader's
    missing-tensor error names them)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__(names)
        self.missing_parts: dict[str, list[str]] = {}


def unfuse_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                      fused: dict[str, list[tuple[str, int]]],
                      params: dict[str, nn.Parameter] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Split checkpoint tensors that fuse several modules along their outputs: a tensor whose
    name holds ``.{frag}.`` for a key of ``fused`` (``{"qkv_proj": [("q_proj", q_rows),
    ("k_proj", kv_rows), ("v_proj", kv_rows)]}``) becomes one tensor per part, renamed, so
    the model's ``packed_modules_mapping`` loads each as its shard (and TP cuts each part on
    its own). A quantized tensor (its parameter in ``params``, the model's, named like the
    checkpoint tensor, carries a ``quant_spec``) is split along its spec's output dimension in
    packed units (GPTQ / AWQ ``qweight``, ``qzeros``, ``scales``), or handed whole to every part
    where it has none (GPTQ's shared ``g_idx``). A size that disagrees with config.json is a
    one-line ValueError."""
    params = params or {}
    for name, tensor in weights:
        frag = next((f for f in fused if f".{f}." in name), None)
        if frag is None:
            yield name, tensor
            continue
        parts = fused[frag]
        spec = getattr(params.get(name), "quant_spec", None)
        dim, div = (0, 1) if spec is None else (spec.output_dim, spec.output_div)
        if dim is None:
            for part, _ in parts:
                yield name.replace(f".{frag}.", f".{part}."), tensor
            continue
        sizes = [size // div for _, size in parts]
        if tensor.dim() <= dim or tensor.shape[dim] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                             f"config.json gives {sum(sizes)} in dim {dim} "
                             f"({' + '.join(f'{p} {s}' for p, s in parts)}"
                             f"{f', in units of {div}' if div > 1 else ''})")
        for (part, _), piece in zip(parts, tensor.split(sizes, dim=dim)):
            yield name.replace(f".{frag}.", f".{part}."), piece
