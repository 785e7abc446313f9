"""A placeholder for a module another pipeline stage holds (vLLM's ``PPMissingLayer``): it keeps
the module tree's names and layer indices the same on every stage, owns no parameter, and fails
loudly if it is ever called."""

from __future__ import annotations

from typing import Any

from torch import nn


class PPMissingLayer(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this module belongs to another pipeline stage")
