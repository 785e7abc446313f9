"""The linear method shared by every format: a format's ``QuantScheme`` names its checkpoint
tensors and unpacks them into an ``IntWeight``; this class registers them, unpacks them once
after loading and runs the kernel chosen for this platform (on a CPU, with the kernel set the
layer was built with: ``layer.kernels``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from bladellm.quantization import cpu_kernels
from bladellm.quantization.int_weight import IntWeight
from bladellm.quantization.linear_method import LinearMethodBase
from bladellm.quantization.params import ParamSpec, register_params


class QuantScheme(ABC):
    """One format's view of a linear layer's checkpoint tensors."""

    #: "weight_only" (W4A16 / W8A16) or "w8a8" (int8 weights and per-token int8 activations)
    kind: str = "weight_only"

    @abstractmethod
    def param_specs(self, layer: nn.Module, input_size: int,
                    output_sizes: list[int]) -> list[ParamSpec]:
        """The tensors of this rank's shard (``input_size`` x ``sum(output_sizes)``)."""

    @abstractmethod
    def to_int_weight(self, params: dict[str, torch.Tensor]) -> IntWeight:
        """Unpack the loaded tensors (by name) into the internal form, ``[N, K]`` of the shard."""

    def check_layer(self, layer: nn.Module) -> None:
        """Refuse a layer this scheme cannot serve under this TP layout (default: any)."""


class QuantLinearMethod(LinearMethodBase):
    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        self.scheme.check_layer(layer)
        specs = self.scheme.param_specs(layer, input_size_per_partition, output_partition_sizes)
        register_params(layer, specs)
        layer.quant_param_names = [s.name for s in specs]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after loading: checkpoint tensors -> ``IntWeight`` -> the kernel's layout.
        The checkpoint tensors are dropped; the kernel's tensors are buffers, so the memory
        accounting (``model_weight_bytes``) sees the layer's real size."""
        names = layer.quant_param_names
        params = {name: getattr(layer, name).data for name in names}
        w = self.scheme.to_int_weight(params)
        expected = (sum(layer.output_partition_sizes), layer.input_size_per_partition)
        if tuple(w.q.shape) != expected:
            raise ValueError(f"{layer.prefix}: unpacked weight {tuple(w.q.shape)} != {expected}")
        if w.q.device.type == "cuda":
            from bladellm.quantization import gpu_kernels

            kernel = (gpu_kernels.TritonW8A8Linear(w) if self.scheme.kind == "w8a8"
                      else gpu_kernels.TritonWeightOnlyLinear(w))
        elif self.scheme.kind == "w8a8":
            kernel = cpu_kernels.choose_w8a8_kernel(w)
        else:
            kernel = cpu_kernels.choose_weight_only_kernel(w, layer.kernels)
        for name in names:
            delattr(layer, name)
        layer.quant_kernel = kernel
        # Memory the kernel holds outside tensors (fbgemm's packed weight): counted by
        # ``model_weight_bytes``, so the auto KV pool leaves room for it.
        layer.opaque_weight_bytes = getattr(kernel, "opaque_bytes", 0)
        for attr in ("codes", "scales", "zeros", "packed", "scales_and_zeros", "wq", "w_scale"):
            for owner, tag in ((kernel, ""), (getattr(kernel, "fallback", None), "fallback_")):
                t = getattr(owner, attr, None) if owner is not None else None
                if isinstance(t, torch.Tensor):
                    layer.register_buffer(f"_q_{tag}{attr}", t, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.quant_kernel(x, bias)
