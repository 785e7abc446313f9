"""``LoRALinear``: a base linear layer plus the per-token delta of each token's adapter slot.

The device tier lives here: every wrapped layer holds stacks with one slot per device-resident
adapter (``--max_loras``), sized for ``--max_lora_rank`` (a smaller rank is zero-padded, which
adds exact zeros). A fused layer (q/k/v, gate/up) keeps one A block and one B stack per slice, so
an adapter may target any subset of its slices; untargeted slices stay zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bladellm.lora.adapter import LoRALayout
from bladellm.lora.ops import lora_delta
from bladellm.model.utils import tp_all_reduce


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slice_names: tuple[str, ...], num_slots: int,
                 max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.slice_names = slice_names
        self.rank = max_rank
        sizes = list(base.output_partition_sizes)
        if len(sizes) != len(slice_names):
            raise ValueError(f"{base.prefix}: {len(sizes)} output slices, expected "
                             f"{len(slice_names)}")
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        # Tensor parallelism: this rank holds output rows [start, start + size) of each slice
        # (column-parallel) or input columns [input_start, +in_features) (row-parallel); the
        # adapter's full A and B are cut the same way in set_slot.
        self.out_starts = [start for start, _ in getattr(base, "output_shards", None)
                           or [(0, size) for size in sizes]]
        self.in_start = getattr(base, "input_start", 0)
        # Row-parallel under TP: each rank's delta is a partial sum, so it is added before the
        # all-reduce (forward), not after it.
        self.reduce_after_delta = (getattr(base, "tp_size", 1) > 1
                                   and getattr(base, "reduce_results", False))
        in_features, width = base.input_size_per_partition, len(sizes) * max_rank
        self.register_buffer("lora_a", torch.zeros(num_slots, in_features, width, dtype=dtype),
                             persistent=False)
        # Block-diagonal: slice j's rank rows feed only slice j's output columns.
        self.register_buffer("lora_b", torch.zeros(num_slots, width, sum(sizes), dtype=dtype),
                             persistent=False)
        self.sizes = sizes
        self.kernels = base.kernels  # the set the base layer was built with (--kernels)
        self.register_buffer("slice_offsets", torch.tensor([*self.offsets, sum(sizes)],
                                                           dtype=torch.int64), persistent=False)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's tensors (per PEFT name: A [r, in], scaled B [out, r]) into a slot;
        slices it does not target become zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, name in enumerate(self.slice_names):
            pair = weights.get(name)
            if pair is not None:
                a, b = pair
                in_features = self.lora_a.shape[1]
                a = a[:, self.in_start:self.in_start + in_features]
                b = b[self.out_starts[j]:self.out_starts[j] + self.sizes[j]]
                r, lo = a.shape[0], j * self.rank
                self.lora_a[slot, :, lo:lo + r].copy_(a.t())
                self.lora_b[slot, lo:lo + r, self.offsets[j]:self.offsets[j] + self.sizes[j]] \
                    .copy_(b.t())

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        mapping = getattr(ctx, "lora", None)
        if self.reduce_after_delta:
            base = self.base
            y = base.quant_method.apply(base, x, base.bias if base.tp_rank == 0 else None)
        else:
            y = self.base(x, ctx)
        if mapping is not None:
            lora_delta(x, self.lora_a, self.lora_b, y, mapping, self.kernels, self.rank,
                       self.slice_offsets)
        return tp_all_reduce(y) if self.reduce_after_delta else y


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:  # OPT: model.decoder.layers
        layers = getattr(getattr(inner, "decoder", None), "layers", None)
    if layers is None:  # Bloom: transformer.h
        layers = getattr(getattr(model, "transformer", None), "h", None)
    return layers


def wrap_model(model: nn.Module, layout: LoRALayout, num_slots: int, max_rank: int,
               dtype: torch.dtype) -> dict[tuple[int, str], LoRALinear]:
    """Replace each decoder layer's projections that ``layout.ours`` names by ``LoRALinear``;
    returns them by (layer index, module name; unique within a layer in every layout)."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"--enable_lora: {type(model).__name__} has no decoder layers to adapt")
    for i, layer in enumerate(layers):
        for path, roles in layout.ours.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            child = getattr(parent, name, None)
            if isinstance(child, nn.Module):
                lora = LoRALinear(child, roles, num_slots, max_rank, dtype)
                setattr(parent, name, lora)
                wrapped[(i, name)] = lora
    if not wrapped:
        raise ValueError(f"--enable_lora: no adaptable projections found in "
                         f"{type(model).__name__}")
    return wrapped
