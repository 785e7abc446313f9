"""The interface between a linear layer and whatever stores its weights and runs its matmul.

It lives here, below the layers (``model/layers/linear.py`` imports it), so that quantization
never imports the model: a layer asks its quant config for a method, the method registers the
layer's parameters (``create_weights``) and runs the matmul (``apply``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How a linear layer stores its weights and runs its matmul."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        ...
