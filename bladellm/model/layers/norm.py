"""Norms with an optional fused residual add (the decoder layer's add-then-norm): RMSNorm,
RMSNorm whose weight is stored as an offset from 1, and LayerNorm with a bias.

Each ``forward(x)`` returns the normed x; ``forward(x, residual)`` returns
(norm(x + residual), x + residual) in one call."""

from __future__ import annotations

import torch
from torch import nn

from bladellm.kernels.scope import kernels_for


class RMSNorm(nn.Module):
    """Rounds as transformers does (normalize in fp32, cast back, then scale); the kernels
    (the set the model is built with, ``bladellm.kernels``) reproduce that bit for bit."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.kernels = kernels_for("RMSNorm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class UnitOffsetRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` (the checkpoint stores the offset from 1, as Gemma
    does), computed in fp32 and rounded once, as transformers does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.kernels = kernels_for("UnitOffsetRMSNorm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm_unit_offset(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm_unit_offset(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """nn.LayerNorm over the last dimension, with or without a bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype),
                                 requires_grad=False) if bias else None
        self.kernels = kernels_for("LayerNorm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)
        return self.kernels.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
