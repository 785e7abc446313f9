"""Activations on fused projections."""

from __future__ import annotations

import torch
from torch import nn

from bladellm.kernels.scope import kernels_for


class SiluAndMul(nn.Module):
    """[..., 2*d] (gate | up) -> silu(gate) * up, [..., d]."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = kernels_for("SiluAndMul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)
