"""RMSNorm with an optional fused residual add (the decoder layer's add-then-norm)."""

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
        """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual),
        x + residual), the decoder layer's add-then-norm in one call."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
