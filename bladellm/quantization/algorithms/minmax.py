"""Round to nearest with min-max group parameters: the baseline every other algorithm beats."""

from __future__ import annotations

from torch import nn

from bladellm.quantization.algorithms.base import LayerResult
from bladellm.quantization.algorithms.layer_io import LayerInputs, linear
from bladellm.quantization.algorithms.layouts import layout_of_layer
from bladellm.quantization.algorithms.quantizer import GroupQuantSpec, rtn_quantize


class MinMax:
    name = "minmax"
    needs_calibration = False

    def __init__(self, spec: GroupQuantSpec) -> None:
        self.spec = spec

    def quantize_layer(self, layer: nn.Module, inputs: LayerInputs | None) -> LayerResult:
        return {n: rtn_quantize(linear(layer, n).weight.data, self.spec)
                for n in layout_of_layer(layer).linear_names}
