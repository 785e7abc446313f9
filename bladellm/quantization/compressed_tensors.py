"""compressed-tensors checkpoints as llm-compressor writes them.

``quantization_config``: ``format`` (per config group or top level), ``config_groups`` (each:
``targets`` — module class "Linear", names or "re:" patterns — and ``weights`` /
``input_activations`` quantization args), ``ignore`` (modules kept in float).

* "pack-quantized" (W4A16 / W8A16): ``weight_packed`` int32 ``[N, K * bits / 32]`` — signed
  codes plus ``2**(bits-1)``, packed little-endian along the input; ``weight_scale`` ``[N, G]``;
  asymmetric only: ``weight_zero_point`` int32 ``[N * bits / 32, G]`` packed the same way along
  the output; ``weight_shape`` ``[N, K]``. ``w = (q - zero) * scale``.
* "int-quantized" (W8A8): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` (symmetric,
  per channel); activations int8, symmetric, per token, dynamic. Without input_activations it is
  W8A16 (weight-only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bladellm.quantization.base import QuantConfig, field
from bladellm.quantization.int_weight import IntWeight, default_g_idx, unpack_int32
from bladellm.quantization.method import QuantScheme
from bladellm.quantization.params import ParamSpec, input_range

_W = "quantization_config"
FORMATS = ("pack-quantized", "int-quantized")


@dataclass(frozen=True)
class WeightArgs:
    bits: int
    symmetric: bool
    group_size: int  # -1: per channel


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    fmt: str
    weights: WeightArgs
    int8_activations: bool


def _weight_args(raw: Any, where: str, fmt: str) -> WeightArgs:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected the weights' quantization args, got {raw!r}")
    if field(raw, ["type"], str, "int", where=where) != "int":
        raise ValueError(f"{where}.type: only int weights are supported, got {raw['type']!r}")
    bits = field(raw, ["num_bits"], int, where=where)
    allowed = (4, 8) if fmt == "pack-quantized" else (8,)
    if bits not in allowed:
        raise ValueError(f"{where}.num_bits: {bits} is not supported with format {fmt!r} "
                         f"(supported: {allowed})")
    strategy = field(raw, ["strategy"], str, "tensor", where=where)
    if strategy == "group":
        group_size = field(raw, ["group_size"], int, where=where)
        if group_size <= 0:
            raise ValueError(f"{where}.group_size: must be positive, got {group_size}")
    elif strategy == "channel":
        group_size = -1
    else:
        raise ValueError(f"{where}.strategy: {strategy!r} is not supported (group, channel)")
    if field(raw, ["dynamic"], (bool, str), False, where=where) is not False:
        raise ValueError(f"{where}.dynamic: dynamic weight quantization is not supported")
    actorder = raw.get("actorder")
    if actorder not in (None, False, "weight", "static"):
        raise ValueError(f"{where}.actorder: {actorder!r} is not supported (it stores a "
                         f"weight_g_idx); 'weight' or none are")
    symmetric = field(raw, ["symmetric"], bool, True, where=where)
    if fmt == "int-quantized" and not symmetric:
        raise ValueError(f"{where}.symmetric: int-quantized weights must be symmetric")
    return WeightArgs(bits, symmetric, group_size)


def _int8_token_activations(raw: Any, where: str) -> bool:
    """True for int8 dynamic per-token activations, False for none; anything else refused."""
    if raw is None:
        return False
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected quantization args, got {raw!r}")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True}
    for key, value in want.items():
        if raw.get(key, value if key == "type" else None) != value:
            raise ValueError(f"{where}.{key}: {raw.get(key)!r} is not supported; activations "
                             f"must be int8, symmetric, per token, dynamic")
    return True


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, groups: list[Group], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "CompressedTensorsConfig":
        status = field(raw, ["quantization_status"], str, "compressed")
        if status != "compressed":
            raise ValueError(f"{_W}.quantization_status: {status!r}; only 'compressed' "
                             f"checkpoints are supported")
        if raw.get("kv_cache_scheme") is not None:
            raise ValueError(f"{_W}.kv_cache_scheme: quantized KV-cache scales are not supported")
        top_format = field(raw, ["format"], str, "")
        groups_raw = field(raw, ["config_groups"], dict)
        groups = []
        for name, g in groups_raw.items():
            where = f"{_W}.config_groups.{name}"
            if not isinstance(g, dict):
                raise ValueError(f"{where}: expected an object")
            fmt = field(g, ["format"], str, top_format, where=where)
            if fmt not in FORMATS:
                raise ValueError(f"{where}.format: {fmt!r} is not supported "
                                 f"(supported: {', '.join(FORMATS)})")
            targets = field(g, ["targets"], list, where=where)
            weights = _weight_args(g.get("weights"), f"{where}.weights", fmt)
            acts = _int8_token_activations(g.get("input_activations"),
                                           f"{where}.input_activations")
            if acts and fmt != "int-quantized":
                raise ValueError(f"{where}.input_activations: quantized activations need "
                                 f"format 'int-quantized', not {fmt!r}")
            if g.get("output_activations") is not None:
                raise ValueError(f"{where}.output_activations: not supported")
            groups.append(Group(name, tuple(str(t) for t in targets), fmt, weights, acts))
        if not groups:
            raise ValueError(f"{_W}.config_groups: empty")
        return cls(groups, [str(i) for i in field(raw, ["ignore"], list, [])])

    def describe(self) -> str:
        return "compressed-tensors " + ", ".join(
            f"{g.fmt} {g.weights.bits}-bit{' w8a8' if g.int8_activations else ''}"
            for g in self.groups)

    def _group_of(self, name: str) -> Group | None:
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for group in self.groups:  # llm-compressor: names and patterns before class names
            if any(t != "Linear" and _matches(t, name) for t in group.targets):
                return group
        for group in self.groups:
            if "Linear" in group.targets:
                return group
        return None

    def scheme_for(self, layer: nn.Module, module_names: list[str]) -> QuantScheme | None:
        found = {self._group_of(name) for name in module_names}
        if len(found) != 1:
            raise ValueError(f"{_W}: {module_names} are fused into one layer but fall in "
                             f"different config_groups / ignore entries")
        group = found.pop()
        if group is None:
            return None
        if group.fmt == "pack-quantized":
            return PackedScheme(group.weights)
        return Int8Scheme(group.weights, group.int8_activations)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or name.endswith("." + pattern)


def _group_layout(layer: nn.Module, args: WeightArgs, input_size: int) -> tuple[int, int | None]:
    full = input_range(layer)[2]
    if args.group_size == -1:
        return 1, None
    if full % args.group_size:
        raise ValueError(f"quantization_config weights.group_size: {args.group_size} does not "
                         f"divide {layer.prefix}'s {full} input features")
    return input_size // args.group_size, 1


class PackedScheme(QuantScheme):
    def __init__(self, args: WeightArgs) -> None:
        self.args = args
        self.pack = 32 // args.bits

    def param_specs(self, layer: nn.Module, input_size: int,
                    output_sizes: list[int]) -> list[ParamSpec]:
        n, pack, gs = sum(output_sizes), self.pack, self.args.group_size
        groups, group_dim = _group_layout(layer, self.args, input_size)
        specs = [
            ParamSpec("weight_packed", (n, input_size // pack), torch.int32, 1, pack, 0, 1),
            ParamSpec("weight_scale", (n, groups), torch.float32, group_dim, max(gs, 1), 0, 1),
            ParamSpec("weight_shape", (2,), torch.int64, is_shape=True),
        ]
        if not self.args.symmetric:
            specs.append(ParamSpec("weight_zero_point", (n // pack, groups), torch.int32,
                                   group_dim, max(gs, 1), 0, pack))
        return specs

    def to_int_weight(self, params: dict[str, torch.Tensor]) -> IntWeight:
        bits, offset = self.args.bits, 1 << (self.args.bits - 1)
        q = unpack_int32(params["weight_packed"], bits, dim=1) - offset
        scales = params["weight_scale"].contiguous()
        zeros = None
        if not self.args.symmetric:
            zeros = (unpack_int32(params["weight_zero_point"], bits, dim=0) - offset).contiguous()
        k, groups = q.shape[1], scales.shape[1]
        return IntWeight(q.contiguous(), scales, zeros, default_g_idx(k, k // groups), bits)


class Int8Scheme(QuantScheme):
    def __init__(self, args: WeightArgs, int8_activations: bool) -> None:
        self.args = args
        self.kind = "w8a8" if int8_activations else "weight_only"
        if int8_activations and args.group_size != -1:
            raise ValueError("quantization_config weights.strategy: W8A8 needs 'channel'")

    def param_specs(self, layer: nn.Module, input_size: int,
                    output_sizes: list[int]) -> list[ParamSpec]:
        n, gs = sum(output_sizes), self.args.group_size
        groups, group_dim = _group_layout(layer, self.args, input_size)
        return [ParamSpec("weight", (n, input_size), torch.int8, 1, 1, 0, 1),
                ParamSpec("weight_scale", (n, groups), torch.float32, group_dim, max(gs, 1), 0, 1)]

    def to_int_weight(self, params: dict[str, torch.Tensor]) -> IntWeight:
        q = params["weight"].to(torch.int16)
        scales = params["weight_scale"].contiguous()
        k, groups = q.shape[1], scales.shape[1]
        return IntWeight(q, scales, None, default_g_idx(k, k // groups), 8)
