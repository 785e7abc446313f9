"""Running one Hugging Face decoder layer over the calibration set, and watching its linears.

``LayerInputs`` holds, per calibration sample, the hidden states entering the layer and the
keyword arguments the model passes every layer (rotary ``position_embeddings``, the attention
mask, ``position_ids``), captured once in front of layer 0. Samples stay separate (batch 1)
because calibration chunks may differ in length.

Module names are relative to a decoder layer (``self_attn.q_proj``); the Llama family layout
(llama, mistral, qwen2, qwen3) is assumed and checked by ``check_layer_layout``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
O_PROJ = ("self_attn.o_proj",)
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
DOWN = ("mlp.down_proj",)
# Quantized one group after the other, each seeing the already-quantized groups before it
# (AutoGPTQ's ``true_sequential``).
SEQUENTIAL_GROUPS = (QKV, O_PROJ, GATE_UP, DOWN)
LINEAR_NAMES = QKV + O_PROJ + GATE_UP + DOWN


@dataclass
class LayerInputs:
    hidden: list[torch.Tensor]         # per sample [1, seq, hidden]
    kwargs: list[dict[str, Any]]       # per sample, the layer's keyword arguments

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[1] for h in self.hidden)


def check_layer_layout(layer: nn.Module) -> None:
    # A mixture-of-experts layer's MLP is checked by algorithms/moe.py (unfuse_experts).
    moe = getattr(getattr(layer, "mlp", None), "experts", None) is not None
    names = (QKV + O_PROJ) if moe else LINEAR_NAMES
    for name in names + ("input_layernorm", "post_attention_layernorm"):
        try:
            layer.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"--model: decoder layer {type(layer).__name__} has no {name}; "
                             f"blade_llm_quantize supports Llama-family layers only") from e


def _layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    return [_layer_output(layer(h, **kw)) for h, kw in zip(inputs.hidden, inputs.kwargs)]


@contextmanager
def input_hooks(layer: nn.Module, names: tuple[str, ...],
                fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(name, input)`` with the input of each named submodule while inside."""
    handles = [layer.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: fn(n, args[0].detach())) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def capture_inputs(layer: nn.Module, inputs: LayerInputs,
                   names: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """Per sample, the input of each named submodule (``[1, seq, features]``)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    with input_hooks(layer, names, lambda n, x: seen[n].append(x)):
        run_layer(layer, inputs)
    return seen


@torch.no_grad()
def call_submodule(layer: nn.Module, name: str, x: torch.Tensor,
                   kwargs: dict[str, Any]) -> torch.Tensor:
    """The output of submodule ``name`` for input ``x``; attention gets the layer's rotary
    embeddings and mask."""
    module = layer.get_submodule(name)
    if name == "self_attn":
        return _layer_output(module(
            hidden_states=x, position_embeddings=kwargs["position_embeddings"],
            attention_mask=kwargs.get("attention_mask"), position_ids=kwargs.get("position_ids")))
    return module(x)


def linear(layer: nn.Module, name: str) -> nn.Linear:
    module = layer.get_submodule(name)
    assert isinstance(module, nn.Linear), name
    return module
