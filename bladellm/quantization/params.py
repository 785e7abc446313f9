"""Checkpoint tensors of quantized linear layers and how a TP rank cuts its slice out of them.

A quantized layer's tensors are packed or grouped: one element of ``qweight`` may hold 8 input
features, one row of ``scales`` a group of 128. Each ``ParamSpec`` says which dimension runs
along the input and which along the output features, and how many features one element covers
(``*_div``). A rank's shard (``output_shards`` of column-parallel layers, the input partition of
row-parallel ones) must start and end on such a boundary; otherwise the layer is refused with a
ValueError naming --tensor_parallel_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bladellm.quantization.weight_attrs import set_weight_attrs

_QKV = {"q": 0, "k": 1, "v": 2}


@dataclass(frozen=True)
class ParamSpec:
    """A checkpoint tensor ``<layer>.<name>`` of this rank's shape ``shape``.

    ``input_dim`` / ``output_dim``: the dimension along input / output features (None: the
    tensor is the same on every rank along that axis); ``input_div`` / ``output_div``: features
    per element along it (pack factor or group size)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    input_dim: int | None = None
    input_div: int = 1
    output_dim: int | None = None
    output_div: int = 1
    #: compressed-tensors' ``weight_shape``: the unpacked ``[out, in]`` of the checkpoint
    #: tensor, checked against the layer instead of stored
    is_shape: bool = False
    #: one tensor for all fused parts (q/k/v share GPTQ's g_idx): later parts must equal it
    shared: bool = False


def input_range(layer: nn.Module) -> tuple[int, int, int]:
    """(start, size, full size) of the input features this rank holds."""
    full = layer.input_size
    return getattr(layer, "input_start", 0), layer.input_size_per_partition, full


def output_ranges(layer: nn.Module) -> list[tuple[int, int, int]]:
    """(start, size, full size) of each logical output (q/k/v, gate/up) this rank holds."""
    shards = getattr(layer, "output_shards", None) or [(0, layer.output_size)]
    fulls = getattr(layer, "output_full_sizes", None) or [layer.output_size]
    return [(start, size, full) for (start, size), full in zip(shards, fulls)]


def check_shard_boundaries(layer: nn.Module, specs: list[ParamSpec]) -> None:
    """Every rank's slice must fall on pack/group boundaries of every tensor."""
    start, size, full = input_range(layer)
    for spec in specs:
        if spec.input_dim is not None and (start % spec.input_div or size % spec.input_div):
            _refuse(layer, spec, "input", start, size, full, spec.input_div)
        if spec.output_dim is None:
            continue
        for o_start, o_size, o_full in output_ranges(layer):
            if o_start % spec.output_div or o_size % spec.output_div:
                _refuse(layer, spec, "output", o_start, o_size, o_full, spec.output_div)


def _refuse(layer: nn.Module, spec: ParamSpec, what: str, start: int, size: int, full: int,
            div: int) -> None:
    if size == full:
        raise ValueError(f"{layer.prefix}: its {full} {what} features are not a multiple of "
                         f"{div}, which the quantized tensor {spec.name!r} needs (packing / "
                         f"group size)")
    raise ValueError(f"--tensor_parallel_size: {layer.prefix}: this rank's {what} features "
                     f"[{start}, {start + size}) of {full} do not fall on the {div}-feature "
                     f"boundaries of the quantized tensor {spec.name!r} (packing / group size)")


def register_params(layer: nn.Module, specs: list[ParamSpec]) -> None:
    check_shard_boundaries(layer, specs)
    for spec in specs:
        param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)

        def loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None,
                   spec: ParamSpec = spec) -> None:
            load_param(layer, spec, p, loaded, shard_id)

        set_weight_attrs(param, {"weight_loader": loader, "quant_spec": spec})
        layer.register_parameter(spec.name, param)


def _shard_index(layer: nn.Module, shard_id: Any) -> int:
    if shard_id is None:
        if len(output_ranges(layer)) != 1:
            raise ValueError(f"{layer.prefix}: a fused checkpoint tensor needs a shard id")
        return 0
    return _QKV[shard_id] if isinstance(shard_id, str) else int(shard_id)


def load_param(layer: nn.Module, spec: ParamSpec, param: nn.Parameter, loaded: torch.Tensor,
               shard_id: Any) -> None:
    """Copy this rank's slice of checkpoint tensor ``loaded`` into ``param``."""
    if loaded.dtype.is_floating_point != spec.dtype.is_floating_point or \
            (not spec.dtype.is_floating_point and loaded.dtype != spec.dtype):
        raise ValueError(f"quantized tensor {spec.name!r} has dtype {loaded.dtype}, expected "
                         f"{spec.dtype}")
    if loaded.dim() != len(spec.shape):
        raise ValueError(f"quantized tensor {spec.name!r} has shape {tuple(loaded.shape)}, "
                         f"expected {len(spec.shape)} dimensions")
    if spec.is_shape:
        _check_weight_shape(layer, spec, loaded, shard_id)
        return
    dst, src = param.data, loaded
    if spec.input_dim is not None:
        start, size, full = input_range(layer)
        _check_size(spec, src, spec.input_dim, -(-full // spec.input_div), "input")
        src = src.narrow(spec.input_dim, start // spec.input_div, -(-size // spec.input_div))
    if spec.output_dim is not None:
        outs = output_ranges(layer)
        index = _shard_index(layer, shard_id)
        offset = sum(size for _, size, _ in outs[:index]) // spec.output_div
        start, size, full = outs[index]
        _check_size(spec, src, spec.output_dim, full // spec.output_div, "output")
        src = src.narrow(spec.output_dim, start // spec.output_div, size // spec.output_div)
        dst = dst.narrow(spec.output_dim, offset, size // spec.output_div)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"quantized tensor {spec.name!r}: shape mismatch, checkpoint slice "
                         f"{tuple(src.shape)}, parameter expects {tuple(dst.shape)}")
    if spec.shared and getattr(param, "loaded_once", False):
        if not torch.equal(dst, src.to(dst.dtype)):
            raise ValueError(f"quantized tensor {spec.name!r} differs between the modules "
                             f"fused into {layer.prefix}")
        return
    dst.copy_(src)
    param.loaded_once = True


def _check_size(spec: ParamSpec, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if t.size(dim) != expected:
        raise ValueError(f"quantized tensor {spec.name!r} has shape {tuple(t.shape)}, expected "
                         f"{expected} in dim {dim} ({what} features / {spec.__dict__[what + '_div']})")


def _check_weight_shape(layer: nn.Module, spec: ParamSpec, loaded: torch.Tensor,
                        shard_id: Any) -> None:
    full_out = output_ranges(layer)[_shard_index(layer, shard_id)][2]
    got = [int(v) for v in loaded.flatten().tolist()]
    if got != [full_out, layer.input_size]:
        raise ValueError(f"{spec.name!r} says {got}, the model expects "
                         f"[{full_out}, {layer.input_size}]")
