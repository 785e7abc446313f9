"""Attributes a parameter carries for the loader (``weight_loader``, ``input_dim``,
``output_dim``, ``quant_spec``): set by the layers and by the quantized linear methods alike."""

from __future__ import annotations

from typing import Any

from torch import nn


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)
