"""What every format's config provides, and the mapping from engine layer names (fused
``qkv_proj`` / ``gate_up_proj``) to the checkpoint's module names: the model being built hands
its own mapping in (``for_model``; families fuse differently), nothing here assumes Llama's."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from bladellm.quantization.method import QuantLinearMethod, QuantScheme


class QuantConfig(ABC):
    """A checkpoint's ``quantization_config``, validated. ``name`` is the --quantization value."""

    name: str = ""
    #: the model's fused layers: engine layer name -> the checkpoint modules it fuses, in shard
    #: order (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``); empty: nothing is fused
    packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    @abstractmethod
    def from_config(cls, raw: dict[str, Any]) -> "QuantConfig":
        """Validate ``raw``; anything unsupported is a ValueError naming the field."""

    @abstractmethod
    def scheme_for(self, layer: nn.Module, module_names: list[str]) -> QuantScheme | None:
        """The scheme of a layer made of checkpoint modules ``module_names`` (None: the layer is
        stored unquantized)."""

    def for_model(self, packed_modules_mapping: dict[str, list[str]]) -> "QuantConfig":
        """This config for a model that fuses ``packed_modules_mapping`` (the model class's
        attribute of that name); the loader calls it before building the model."""
        config = copy.copy(self)
        config.packed_modules_mapping = dict(packed_modules_mapping)
        return config

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantLinearMethod | None:
        names = checkpoint_module_names(prefix, self.packed_modules_mapping)
        scheme = self.scheme_for(layer, names)
        return QuantLinearMethod(scheme) if scheme is not None else None

    def describe(self) -> str:
        return self.name


def checkpoint_module_names(prefix: str,
                            packed_modules_mapping: dict[str, list[str]]) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the q/k/v module names it fuses, by the model's
    ``packed_modules_mapping``; a layer it does not name is its own checkpoint module."""
    parent, _, leaf = prefix.rpartition(".")
    parts = packed_modules_mapping.get(leaf, [])
    if not parts:
        return [prefix]
    return [f"{parent}.{p}" if parent else p for p in parts]


REQUIRED = object()


def field(raw: dict[str, Any], names: list[str], kind: type | tuple[type, ...],
          default: Any = REQUIRED, *, where: str = "quantization_config") -> Any:
    """The first of ``names`` present in ``raw`` (several spellings exist in the wild),
    type-checked (None counts as absent); ``default`` if none is present."""
    for name in names:
        if raw.get(name) is not None:
            value = raw[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"{where}.{name}: expected {_kind_name(kind)}, got {value!r}")
            return value
    if default is REQUIRED:
        raise ValueError(f"{where}: missing field {names[0]!r}")
    return default


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
