"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (``checkpoint_format`` "gptq", v1).

Per linear layer, ``K`` inputs, ``N`` outputs, ``G`` groups, ``pack = 32 // bits``:
``qweight`` int32 ``[K / pack, N]`` (packed along the input), ``qzeros`` int32
``[G, N / pack]`` (packed along the output) holding ``zero - 1`` (the v1 convention that
GPTQModel's "gptq_v2" drops), ``scales`` fp16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (the group of
each input column; scattered with ``desc_act``). ``w = (q - (qzero + 1)) * scale``.

GPTQModel's ``dynamic``: ``"-:<regex>"`` keys exclude the modules the regex matches (``re.match``
on the module name, as GPTQModel and vLLM apply it) from quantization, e.g. a MoE router or
shared expert left float; per-module overrides (``"+:<regex>"`` or a bare regex) are refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from bladellm.quantization.base import QuantConfig, field
from bladellm.quantization.int_weight import IntWeight, default_g_idx, unpack_int32
from bladellm.quantization.method import QuantScheme
from bladellm.quantization.params import ParamSpec, input_range

_WHERE = "quantization_config"


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool,
                 excluded: tuple[str, ...] = ()) -> None:
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        #: GPTQModel ``dynamic`` "-:" patterns: modules left float
        self.excluded = excluded

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "GPTQConfig":
        bits = field(raw, ["bits"], int)
        if bits not in (4, 8):
            raise ValueError(f"{_WHERE}.bits: {bits}-bit GPTQ is not supported (4 or 8)")
        group_size = field(raw, ["group_size"], int)
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{_WHERE}.group_size: must be positive or -1, got {group_size}")
        fmt = field(raw, ["checkpoint_format"], str, "gptq")
        if fmt != "gptq":
            raise ValueError(f"{_WHERE}.checkpoint_format: {fmt!r} is not supported; only "
                             f"'gptq' (v1: zero points stored minus one)")
        if field(raw, ["lm_head"], bool, False):
            raise ValueError(f"{_WHERE}.lm_head: a quantized lm_head is not supported")
        excluded = []
        for key in field(raw, ["dynamic"], dict, {}):
            if not str(key).startswith("-:"):
                raise ValueError(f"{_WHERE}.dynamic: per-module overrides ({key!r}) are not "
                                 f"supported; only '-:' exclusions are")
            try:
                re.compile(key[2:])
            except re.error as e:
                raise ValueError(f"{_WHERE}.dynamic: {key!r} is not a regex: {e}") from e
            excluded.append(key[2:])
        return cls(bits, group_size, field(raw, ["desc_act"], bool, False),
                   field(raw, ["sym"], bool, True), tuple(excluded))

    def describe(self) -> str:
        return (f"gptq {self.bits}-bit group {self.group_size} "
                f"{'sym' if self.sym else 'asym'}{' desc_act' if self.desc_act else ''}")

    def scheme_for(self, layer: nn.Module, module_names: list[str]) -> QuantScheme | None:
        skipped = [any(re.match(p, name) for p in self.excluded) for name in module_names]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{_WHERE}.dynamic: {module_names} are fused into one layer but "
                             f"only some of them are excluded")
        return GPTQScheme(self)


class GPTQScheme(QuantScheme):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config
        self.pack = 32 // config.bits

    def _act_order(self) -> bool:
        return self.config.desc_act and self.config.group_size != -1

    def check_layer(self, layer: nn.Module) -> None:
        start, size, full = input_range(layer)
        if self._act_order() and size != full:
            raise ValueError(
                f"--tensor_parallel_size: {layer.prefix} is split along its input features, "
                f"which GPTQ act-order (quantization_config.desc_act=true) does not support "
                f"here: its groups are scattered over the input; serve it with "
                f"--tensor_parallel_size 1")
        gs = self.config.group_size
        if gs != -1 and full % gs:
            raise ValueError(f"quantization_config.group_size: {gs} does not divide "
                             f"{layer.prefix}'s {full} input features")

    def param_specs(self, layer: nn.Module, input_size: int,
                    output_sizes: list[int]) -> list[ParamSpec]:
        n, gs, pack = sum(output_sizes), self.config.group_size, self.pack
        if gs == -1:
            groups, group_dim = 1, None
        elif self._act_order():
            groups, group_dim = input_size // gs, None  # full input on every rank
        else:
            groups, group_dim = input_size // gs, 0
        return [
            ParamSpec("qweight", (input_size // pack, n), torch.int32, 0, pack, 1, 1),
            ParamSpec("qzeros", (groups, n // pack), torch.int32, group_dim, max(gs, 1), 1, pack),
            ParamSpec("scales", (groups, n), torch.float32, group_dim, max(gs, 1), 1, 1),
            ParamSpec("g_idx", (input_size,), torch.int32, 0, 1, shared=True),
        ]

    def to_int_weight(self, params: dict[str, torch.Tensor]) -> IntWeight:
        bits = self.config.bits
        q = unpack_int32(params["qweight"], bits, dim=0).t()
        zeros = (unpack_int32(params["qzeros"], bits, dim=1) + 1).t()
        scales = params["scales"].t().contiguous()
        k, groups = q.shape[1], scales.shape[1]
        if self._act_order():
            g_idx = params["g_idx"].to(torch.int64)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(f"g_idx: group indices outside [0, {groups})")
        else:  # in-order groups: g_idx carries nothing (vLLM ignores it too)
            g_idx = default_g_idx(k, k // groups)
        return IntWeight(q.contiguous(), scales, zeros.contiguous(), g_idx, bits)
