"""Serving quantized checkpoints (GPTQ, AWQ, compressed-tensors) unchanged.

``get_quant_config(hf_config, --quantization)`` validates ``config.json``'s
``quantization_config``; the model's linear layers ask it for their ``QuantLinearMethod``, which
registers the checkpoint's tensors, unpacks them after loading (``process_quantized_layers``)
into one internal layout per kernel and runs the kernel chosen for this CPU. See
docs/quantization.md.
"""

from __future__ import annotations

from torch import nn

from bladellm.quantization.base import QuantConfig
from bladellm.quantization.detect import QUANTIZATION_CHOICES, get_quant_config
from bladellm.quantization.method import QuantLinearMethod

__all__ = ["QUANTIZATION_CHOICES", "QuantConfig", "get_quant_config",
           "process_quantized_layers"]


def process_quantized_layers(model: nn.Module) -> int:
    """Unpack every quantized layer's checkpoint tensors into its kernel layout (once, after
    loading). Returns the number of layers processed."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                       QuantLinearMethod)]
    for layer in layers:
        try:
            layer.quant_method.process_weights_after_loading(layer)
        except ValueError as e:
            raise ValueError(f"{layer.prefix}: {e}") from e
    return len(layers)
