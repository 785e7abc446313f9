"""What an offline algorithm does with one decoder layer."""

from __future__ import annotations

from typing import Protocol, Union

from torch import nn

from bladellm.quantization.algorithms.layer_io import LayerInputs
from bladellm.quantization.algorithms.quantizer import Int8ChannelWeight, QuantizedWeight

LayerResult = dict[str, Union[QuantizedWeight, Int8ChannelWeight]]


class LayerAlgorithm(Protocol):
    name: str
    needs_calibration: bool

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        """Quantize every linear of ``layer`` (float32, modified in place: smoothing scales are
        folded into its norms / linears) and return the integer weights by module name.
        ``inputs`` is None when ``needs_calibration`` is False."""
        ...
