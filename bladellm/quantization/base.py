"""What every format's config provides, and the mapping from engine layer names (fused
``qkv_proj`` / ``gate_up_proj``) to the checkpoint's module names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from bladellm.model.utils import LLAMA_STACKED_PARAMS
from bladellm.quantization.method import QuantLinearMethod, QuantScheme


class QuantConfig(ABC):
    """A checkpoint's ``quantization_config``, validated. ``name`` is the --quantization value."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, raw: dict[str, Any]) -> "QuantConfig":
        """Validate ``raw``; anything unsupported is a ValueError naming the field."""

    @abstractmethod
    def scheme_for(self, layer: nn.Module, module_names: list[str]) -> QuantScheme | None:
        """The scheme of a layer made of checkpoint modules ``module_names`` (None: the layer is
        stored unquantized)."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantLinearMethod | None:
        scheme = self.scheme_for(layer, checkpoint_module_names(prefix))
        return QuantLinearMethod(scheme) if scheme is not None else None

    def describe(self) -> str:
        return self.name


def checkpoint_module_names(prefix: str) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the q/k/v module names it fuses."""
    parent, _, leaf = prefix.rpartition(".")
    parts = [ckpt for fused, ckpt, _ in LLAMA_STACKED_PARAMS if fused == leaf]
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
