"""Activations picked from the config's ``hidden_act``: gated on a fused (gate | up) projection
(SwiGLU, GeGLU) or plain (OPT's ReLU, Bloom's and Phi's GELU MLPs)."""

from __future__ import annotations

import torch
from torch import nn

from bladellm.kernels.scope import kernels_for

# transformers' ``hidden_act`` names -> the kernels' activation names (kernels/ref.py
# ACTIVATIONS). gelu_new and gelu_pytorch_tanh are one function computed two ways; each keeps
# the twin transformers evaluates for it.
HF_ACTIVATIONS: dict[str, str] = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_new",
    "relu": "relu",
}


def kernel_activation(name: str, field: str = "hidden_act") -> str:
    """The kernels' name for transformers' activation ``name``; a one-line ValueError naming
    it (and the config field it came from) where none exists."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} ({field} in config.json); supported: "
                         f"{', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


class ActAndMul(nn.Module):
    """[..., 2*d] (gate | up) -> act(gate) * up, [..., d]."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.kernels = kernels_for(type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.act_and_mul(x, self.act)

    def extra_repr(self) -> str:
        return self.act


class SiluAndMul(ActAndMul):
    """SwiGLU; its own kernel (the one the compiled decoder stack runs)."""

    def __init__(self) -> None:
        super().__init__("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class Activation(nn.Module):
    """act(x), elementwise."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = act
        self.kernels = kernels_for("Activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.activation(x, self.act)

    def extra_repr(self) -> str:
        return self.act


def get_act_fn(name: str, gated: bool, field: str = "hidden_act") -> nn.Module:
    """The layer for transformers' activation ``name``: gated (``ActAndMul``, on a fused
    gate | up projection) or plain (``Activation``). ``field``: the config field ``name`` came
    from, for the error."""
    act = kernel_activation(name, field)
    if not gated:
        return Activation(act)
    return SiluAndMul() if act == "silu" else ActAndMul(act)
