"""RMSNorm with an optional fused residual add (the decoder layer's add-then-norm)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype),
                                   requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same rounding as transformers: normalize in fp32, cast back, then scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual),
        x + residual), the decoder layer's add-then-norm in one call."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
