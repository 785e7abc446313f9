"""Running one Hugging Face decoder layer over the calibration set, and watching its linears.

``LayerInputs`` holds, per calibration sample, the hidden states entering the layer and the
keyword arguments the model passes every layer (rotary ``position_embeddings``, the attention
mask, ``position_ids``), captured once in front of layer 0. Samples stay separate (batch 1)
because calibration chunks may differ in length.

Module names are relative to a decoder layer (``self_attn.q_proj``); each family's names are its
``LayerLayout`` (layouts.py), checked by ``check_layer_layout``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from bladellm.quantization.algorithms.layouts import LLAMA, layout_of_layer

# The Llama family's: quantized one group after the other, each seeing the already-quantized
# groups before it (AutoGPTQ's ``true_sequential``).
SEQUENTIAL_GROUPS = LLAMA.sequential
LINEAR_NAMES = LLAMA.linear_names


@dataclass
class LayerInputs:
    hidden: list[torch.Tensor]         # per sample [1, seq, hidden]
    kwargs: list[dict[str, Any]]       # per sample, the layer's keyword arguments

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[1] for h in self.hidden)


def check_layer_layout(layer: nn.Module) -> None:
    layout = layout_of_layer(layer)
    for name in layout.linear_names + layout.norms:
        try:
            layer.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"--model: decoder layer {type(layer).__name__} has no {name}; "
                             f"blade_llm_quantize reads the Llama, OPT, Phi-3, GLM, Gemma "
                             f"and Bloom layer layouts only") from e


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """A causal LM's decoder layers (``model.layers``; OPT: ``model.decoder.layers``; Bloom:
    ``transformer.h``)."""
    inner = model.base_model
    if hasattr(inner, "decoder"):
        return inner.decoder.layers
    return inner.h if hasattr(inner, "h") else inner.layers


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
    if name == "self_attn":  # OPT's attention takes no position_embeddings (learned positions)
        passed = {k: kwargs[k] for k in ("position_embeddings", "position_ids")
                  if kwargs.get(k) is not None}
        return _layer_output(module(hidden_states=x, attention_mask=kwargs.get("attention_mask"),
                                    **passed))
    return module(x)


def linear(layer: nn.Module, name: str) -> nn.Linear:
    module = layer.get_submodule(name)
    assert isinstance(module, nn.Linear), name
    return module
