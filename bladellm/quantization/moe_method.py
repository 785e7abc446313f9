"""Quantized experts of a mixture-of-experts layer (GPTQ, AWQ, compressed-tensors checkpoints).

Each expert's projections stay what the checkpoint stores: ``experts.{e}.gate_proj`` /
``up_proj`` (fused into one ``gate_up_proj`` of two outputs, as a dense MLP's) and
``down_proj``, each an ``ExpertProjection``: a linear layer's geometry (this rank's input and
output ranges) with the format's ``QuantLinearMethod``, so the dense path registers, cuts (TP on
pack / group boundaries, refused with a ValueError naming --tensor_parallel_size otherwise),
unpacks and runs them (``process_quantized_layers`` finds them as any quantized linear; the
weight stays 4- or 8-bit in memory, the kernel is the dense one chosen for this platform).

``quantized_fused_moe`` runs only the experts that some token selected, each on its tokens; its
twin is ``kernels.ref.fused_moe`` on the dequantized weights (``dequantize``), which the tests
check it against.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from bladellm.quantization.method import QuantLinearMethod


class ExpertProjection(nn.Module):
    """One expert's ``gate_up_proj`` or ``down_proj`` as a quantized linear layer of this rank:
    inputs ``[input_start, input_start + input_size_per_partition)`` of ``input_size``, outputs
    ``output_shards`` (``(start, size)`` of each fused output of full size
    ``output_full_sizes``)."""

    def __init__(self, prefix: str, input_size: int, input_start: int, input_size_per_partition: int,
                 output_shards: list[tuple[int, int]], output_full_sizes: list[int],
                 method: QuantLinearMethod, kernels: Any) -> None:
        super().__init__()
        self.prefix, self.kernels = prefix, kernels
        self.input_size, self.input_start = input_size, input_start
        self.input_size_per_partition = input_size_per_partition
        self.output_shards, self.output_full_sizes = output_shards, output_full_sizes
        self.output_size = sum(output_full_sizes)
        self.output_partition_sizes = [size for _, size in output_shards]
        self.quant_method = method
        method.create_weights(self, input_size_per_partition, self.output_partition_sizes,
                              torch.float32, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


def expert_schemes(quant_config: Any, layer: nn.Module, prefix: str, num_experts: int,
                   part_names: tuple[str, str, str]) -> list[tuple[Any, Any]] | None:
    """Per expert, the (gate_up, down) ``QuantScheme`` the checkpoint gives it; None where every
    expert is stored in float (``modules_to_not_convert`` / ``ignore``). Some experts quantized
    and others not: a ValueError (the stacked float path and the quantized one do not mix)."""
    gate, up, down = part_names
    schemes = []
    for e in range(num_experts):
        base = f"{prefix}.{e}"
        schemes.append((quant_config.scheme_for(layer, [f"{base}.{gate}", f"{base}.{up}"]),
                        quant_config.scheme_for(layer, [f"{base}.{down}"])))
    quantized = [s is not None for pair in schemes for s in pair]
    if not any(quantized):
        return None
    if not all(quantized):
        floats = [f"{prefix}.{e}.{'gate_up' if i == 0 else down}"
                  for e, pair in enumerate(schemes) for i, s in enumerate(pair) if s is None]
        raise ValueError(f"quantization_config: {prefix}: experts {floats[:4]} are stored in "
                         f"float while others are quantized (modules_to_not_convert / ignore); "
                         f"a layer's experts must be all quantized or all float")
    return schemes


class QuantMoEMethod:
    """The quantized experts of one ``FusedMoE`` layer: builds its ``ExpertProjection`` pairs,
    loads the checkpoint's per-expert tensors into them and runs the selected experts."""

    def __init__(self, schemes: list[tuple[Any, Any]]) -> None:
        self.schemes = schemes

    def create_weights(self, layer: nn.Module) -> nn.ModuleList:
        """``layer``'s geometry: ``expert_start``, ``num_local_experts``, ``hidden_size``,
        ``intermediate_size`` and this rank's ``inter_start`` / ``inter_size``."""
        H, I = layer.hidden_size, layer.intermediate_size
        start, size = layer.inter_start, layer.inter_size
        experts = nn.ModuleList()
        for local in range(layer.num_local_experts):
            e = layer.expert_start + local
            gate_up_scheme, down_scheme = self.schemes[e]
            base = f"{layer.prefix}.{e}"
            experts.append(nn.ModuleDict({
                "gate_up_proj": ExpertProjection(
                    f"{base}.gate_up_proj", H, 0, H, [(start, size), (start, size)], [I, I],
                    QuantLinearMethod(gate_up_scheme), layer.kernels),
                "down_proj": ExpertProjection(
                    f"{base}.down_proj", I, start, size, [(0, H)], [H],
                    QuantLinearMethod(down_scheme), layer.kernels),
            }))
        return experts

    @staticmethod
    def load(experts: nn.ModuleList, local: int, which: str, part: int, tensor_name: str,
             tensor: torch.Tensor) -> str:
        """One checkpoint tensor (``experts.{e}.gate_proj.qweight``, ...) into its slot; returns
        the parameter's name under ``experts``."""
        proj = experts[local][which]
        if tensor_name not in proj.quant_param_names:
            raise ValueError(f"unexpected tensor {tensor_name!r} for a quantized expert "
                             f"projection (expected {', '.join(proj.quant_param_names)})")
        param = getattr(proj, tensor_name)
        param.weight_loader(param, tensor, part if which == "gate_up_proj" else None)
        return f"{local}.{which}.{tensor_name}"

    @staticmethod
    def apply(experts: nn.ModuleList, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
              hidden_size: int) -> torch.Tensor:
        return quantized_fused_moe(
            x, [(pair["gate_up_proj"], pair["down_proj"]) for pair in experts], topk_weights,
            topk_ids, silu_and_mul, hidden_size)


def quantized_fused_moe(x: torch.Tensor, experts: Sequence[tuple[Callable, Callable]],
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                        hidden_size: int) -> torch.Tensor:
    """``kernels.ref.fused_moe`` with each expert's projections given as callables (quantized
    linears): tokens grouped by expert, only the selected experts run, contributions added in
    ascending expert order; ids outside ``[0, len(experts))`` contribute nothing (another rank
    holds that expert). Returns ``[T, hidden_size]``."""
    T, E = x.shape[0], len(experts)
    out = torch.zeros(T, hidden_size, dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    weights = topk_weights.to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(-1, E).add(1), minlength=E + 2)[1:E + 1].tolist()
    start = int((flat < 0).sum())
    k = max(ids.shape[1], 1)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        gate_up, down = experts[e]
        y = down(silu_and_mul(gate_up(x.index_select(0, tok))))
        y = y * weights.reshape(-1)[pairs, None]
        out.index_add_(0, tok, y)
    return out


__all__ = ["ExpertProjection", "QuantMoEMethod", "expert_schemes", "quantized_fused_moe"]
