"""AWQ checkpoints as AutoAWQ writes them ("gemm" version).

Per linear layer, ``K`` inputs, ``N`` outputs, ``G`` groups: ``qweight`` int32 ``[K, N / 8]`` and
``qzeros`` int32 ``[G, N / 8]``, both packed along the output, eight 4-bit values per word in the
interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``j`` holds column ``order[j]`` of its
eight); ``scales`` fp16 ``[G, N]``. ``w = (q - zero) * scale`` (no "minus one" as in GPTQ).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bladellm.quantization.base import QuantConfig, field
from bladellm.quantization.int_weight import IntWeight, default_g_idx, unpack_int32
from bladellm.quantization.method import QuantScheme
from bladellm.quantization.params import ParamSpec, input_range

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# Nibble holding column c of an eight: the inverse of AWQ_PACK_ORDER.
AWQ_UNPACK_ORDER = [AWQ_PACK_ORDER.index(c) for c in range(8)]
_WHERE = "quantization_config"


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "AWQConfig":
        bits = field(raw, ["w_bit", "bits"], int)
        if bits != 4:
            raise ValueError(f"{_WHERE}.w_bit: {bits}-bit AWQ is not supported (4 only)")
        group_size = field(raw, ["q_group_size", "group_size"], int)
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{_WHERE}.q_group_size: must be positive or -1, got {group_size}")
        if not field(raw, ["zero_point"], bool, True):
            raise ValueError(f"{_WHERE}.zero_point: AWQ without zero points is not supported")
        version = field(raw, ["version"], str, "gemm")
        if version.lower() != "gemm":
            raise ValueError(f"{_WHERE}.version: {version!r} is not supported; only 'gemm' "
                             f"(the GEMV and Marlin layouts pack differently)")
        skip = field(raw, ["modules_to_not_convert"], list, [])
        return cls(group_size, [str(m) for m in skip])

    def describe(self) -> str:
        return f"awq 4-bit group {self.group_size}"

    def scheme_for(self, layer: nn.Module, module_names: list[str]) -> QuantScheme | None:
        # AutoAWQ skips a module when any listed string is part of its name.
        skipped = [any(s in name for s in self.modules_to_not_convert) for name in module_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"quantization_config.modules_to_not_convert: {module_names} are "
                             f"fused into one layer but only some of them are quantized")
        return AWQScheme(self.group_size)


class AWQScheme(QuantScheme):
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def check_layer(self, layer: nn.Module) -> None:
        full = input_range(layer)[2]
        if self.group_size != -1 and full % self.group_size:
            raise ValueError(f"quantization_config.q_group_size: {self.group_size} does not "
                             f"divide {layer.prefix}'s {full} input features")

    def param_specs(self, layer: nn.Module, input_size: int,
                    output_sizes: list[int]) -> list[ParamSpec]:
        n, gs = sum(output_sizes), self.group_size
        groups, group_dim = (1, None) if gs == -1 else (input_size // gs, 0)
        return [
            ParamSpec("qweight", (input_size, n // 8), torch.int32, 0, 1, 1, 8),
            ParamSpec("qzeros", (groups, n // 8), torch.int32, group_dim, max(gs, 1), 1, 8),
            ParamSpec("scales", (groups, n), torch.float32, group_dim, max(gs, 1), 1, 1),
        ]

    def to_int_weight(self, params: dict[str, torch.Tensor]) -> IntWeight:
        q = unpack_int32(params["qweight"], 4, dim=1, order=AWQ_UNPACK_ORDER).t()
        zeros = unpack_int32(params["qzeros"], 4, dim=1, order=AWQ_UNPACK_ORDER).t()
        scales = params["scales"].t().contiguous()
        k, groups = q.shape[1], scales.shape[1]
        return IntWeight(q.contiguous(), scales, zeros.contiguous(),
                         default_g_idx(k, k // groups), 4)
