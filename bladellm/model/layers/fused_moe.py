"""Mixture-of-experts MLP: a router, top-k experts per token, a weighted sum of their outputs.

``FusedMoE`` holds every expert's weights stacked once at load, ``gate_up_proj [E, 2I, H]``
(each expert's gate rows, then its up rows) and ``down_proj [E, H, I]`` — transformers 5's own
layout and names, so a checkpoint saved that way loads as is, and the per-expert tensors of
Hugging Face checkpoints (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
``w1`` / ``w3`` / ``w2``) load into their slot. The forward routes (``Kernels.moe_route``) and
runs ``Kernels.fused_moe``: tokens grouped by expert, one pass over the selected experts only.

Quantized checkpoints (GPTQ, AWQ, compressed-tensors: ``experts.{e}.gate_proj.qweight``, ...)
keep each expert's packed tensors instead of the stacked float ones
(``bladellm/quantization/moe_method.py``): the same TP / EP geometry, the dense quantized
kernels per selected expert.

Parallelism (the group is the tensor-parallel one either way):

* tensor parallel (default): every rank holds all experts, each cut to its share of the
  intermediate size (``split_evenly``, uneven allowed, as ``LlamaMLP``); the partial sums are
  all-reduced, as a row-parallel down_proj's are.
* expert parallel (``--enable_expert_parallel``): each rank holds whole experts, a contiguous
  ``split_evenly`` share. Tokens are replicated on the ranks (attention is tensor parallel), so
  each rank takes an even share of the tokens, sends each (token, slot) pair to the rank that
  owns its expert (all-to-all), computes what it received with its own experts, sends the
  results back (all-to-all) and the token shares are all-gathered again.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from bladellm.distributed.parallel_state import get_ep_group
from bladellm.distributed.partition import shard_range, split_evenly
from bladellm.kernels.scope import kernels_for
from bladellm.model.utils import copy_checked, get_tp_rank_and_size, tp_all_reduce
from bladellm.quantization.moe_method import QuantMoEMethod, expert_schemes
from bladellm.quantization.weight_attrs import set_weight_attrs

# Checkpoint names of one expert's projections -> (our parameter, part of it).
EXPERT_PARTS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0),  # Mixtral
}


class FusedMoE(nn.Module):
    """The experts of one layer; ``forward(x, router_logits)`` -> [T, H], reduced over ranks."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 *, renormalize: bool, params_dtype: torch.dtype, quant_config: Any = None,
                 prefix: str = "",
                 part_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok {top_k} must be in "
                             f"[1, num_experts {num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.prefix = hidden_size, prefix
        self.ep = get_ep_group()
        tp_rank, tp_size = get_tp_rank_and_size()
        if self.ep.world_size > 1:
            if num_experts < self.ep.world_size:
                raise ValueError(f"--enable_expert_parallel: {num_experts} experts cannot be "
                                 f"split over tensor_parallel_size {self.ep.world_size} ranks")
            self.expert_sizes = split_evenly(num_experts, self.ep.world_size)
            self.expert_start, self.num_local_experts = shard_range(self.expert_sizes,
                                                                    self.ep.rank_in_group)
            self.tp_size, self.inter_start, self.inter_size = 1, 0, intermediate_size
        else:
            if intermediate_size < tp_size:
                raise ValueError(f"{prefix}: moe intermediate size {intermediate_size} is "
                                 f"smaller than tensor_parallel_size {tp_size}")
            self.expert_start, self.num_local_experts = 0, num_experts
            self.tp_size = tp_size
            self.inter_start, self.inter_size = shard_range(
                split_evenly(intermediate_size, tp_size), tp_rank)
        self.intermediate_size = intermediate_size
        self.kernels = kernels_for(prefix or "FusedMoE")
        self._loaded: dict[str, set[Any]] = {"gate_up_proj": set(), "down_proj": set()}
        # The kernels' load-time form of the stacked weights (``process_weights_after_loading``).
        self.packed: object | None = None
        schemes = (expert_schemes(quant_config, self, prefix, num_experts, part_names)
                   if quant_config is not None else None)
        # Quantized: each expert's checkpoint projections (``quant_experts``), no stacked
        # float weights; the loader's ``process_quantized_layers`` unpacks them.
        self.quant_method = QuantMoEMethod(schemes) if schemes is not None else None
        if self.quant_method is not None:
            self.quant_experts = self.quant_method.create_weights(self)
            return
        E, I = self.num_local_experts, self.inter_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, hidden_size, dtype=params_dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, I, dtype=params_dtype),
                                      requires_grad=False)
        for p in (self.gate_up_proj, self.down_proj):
            set_weight_attrs(p, {"weight_loader": self.weight_loader})

    # ---- loading ----------------------------------------------------------------------------
    def _narrow(self, which: str, part: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of one expert's checkpoint tensor (``[I, H]`` gate or up, or
        ``[H, I]`` down), checked against the full shape."""
        H, I = self.hidden_size, self.intermediate_size
        want = (I, H) if which == "gate_up_proj" else (H, I)
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(tensor.shape)}, expected {want}")
        dim = 0 if which == "gate_up_proj" else 1
        return tensor.narrow(dim, self.inter_start, self.inter_size)

    def load_expert(self, which: str, expert: int, part: int, tensor: torch.Tensor,
                    tensor_name: str = "weight") -> bool:
        """One expert's checkpoint tensor (``tensor_name``: ``weight``, or a quantized
        checkpoint's ``qweight``, ``scales``, ...) into its slot; False where another rank holds
        that expert (expert parallelism)."""
        local = expert - self.expert_start
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside num_experts {self.num_experts}")
        if not 0 <= local < self.num_local_experts:
            return False
        if self.quant_method is not None:
            name = self.quant_method.load(self.quant_experts, local, which, part, tensor_name,
                                          tensor)
            self._loaded.setdefault("quant", set()).add((name, part))
            return True
        if tensor_name != "weight":
            raise ValueError(f"unexpected tensor {tensor_name!r} for float experts (only "
                             f"'weight'; packed tensors need a quantization_config that "
                             f"quantizes these experts)")
        param = getattr(self, which)
        dst = param.data[local]
        if which == "gate_up_proj":
            dst = dst.narrow(0, part * self.inter_size, self.inter_size)
        copy_checked(dst, self._narrow(which, part, tensor))
        self._loaded[which].add((local, part))
        return True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None:
        """A whole stacked tensor (transformers 5: ``[E, 2I, H]`` / ``[E, H, I]``)."""
        which = "gate_up_proj" if param is self.gate_up_proj else "down_proj"
        H, I, E = self.hidden_size, self.intermediate_size, self.num_experts
        want = (E, 2 * I, H) if which == "gate_up_proj" else (E, H, I)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(loaded.shape)}, expected {want}")
        for e in range(self.expert_start, self.expert_start + self.num_local_experts):
            if which == "gate_up_proj":
                for part in (0, 1):
                    self.load_expert(which, e, part, loaded[e].narrow(0, part * I, I))
            else:
                self.load_expert(which, e, 0, loaded[e])

    def loaded_names(self) -> set[str]:
        """The parameters (relative to this module) that got every tensor this rank holds."""
        if self.quant_method is not None:
            got = self._loaded.get("quant", set())
            return {f"quant_experts.{name}" for name, part in got
                    if ".down_proj." in name or (name, 1 - part) in got}
        return {which for which in ("gate_up_proj", "down_proj") if self.fully_loaded(which)}

    def fully_loaded(self, which: str) -> bool:
        parts = 2 if which == "gate_up_proj" else 1
        return len(self._loaded[which]) == self.num_local_experts * parts

    def process_weights_after_loading(self) -> None:
        """Once, after every weight is loaded: the kernels' packed form (None where none)."""
        self.packed = self.kernels.pack_moe_weights(self.gate_up_proj, self.down_proj)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.kernels.moe_route(router_logits, self.top_k, self.renormalize)
        if self.ep.world_size > 1:
            return self._forward_expert_parallel(x, weights, ids)
        out = self._experts(x, weights, ids)
        return tp_all_reduce(out) if self.tp_size > 1 else out

    def _experts(self, x: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``x`` (``ids`` local; outside them: another rank's)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_experts, x, weights, ids,
                                           self.kernels.silu_and_mul, self.hidden_size)
        return self.kernels.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                      self.packed)

    def _forward_expert_parallel(self, x: torch.Tensor, weights: torch.Tensor,
                                 ids: torch.Tensor) -> torch.Tensor:
        ep, n, k = self.ep, self.ep.world_size, self.top_k
        token_sizes = split_evenly(x.shape[0], n)
        first, count = shard_range(token_sizes, ep.rank_in_group)
        x_mine = x.narrow(0, first, count)
        ids_mine = ids.narrow(0, first, count).reshape(-1)
        w_mine = weights.narrow(0, first, count).reshape(-1)
        # The rank owning each pair's expert; pairs sorted by it (stable: token order kept).
        bounds = torch.tensor(self.expert_sizes, device=ids.device).cumsum(0)
        owner = torch.bucketize(ids_mine, bounds, right=True)
        order = torch.argsort(owner, stable=True)
        send_sizes = torch.bincount(owner, minlength=n).tolist()
        # On the group's device: NCCL moves device tensors only.
        recv_sizes = ep.all_to_all(torch.tensor(send_sizes, dtype=torch.int64,
                                                device=x.device),
                                   [1] * n, [1] * n).tolist()
        tokens = order // k
        recv_x = ep.all_to_all(x_mine.index_select(0, tokens), send_sizes, recv_sizes)
        recv_ids = ep.all_to_all(ids_mine[order], send_sizes, recv_sizes)
        recv_w = ep.all_to_all(w_mine[order].float(), send_sizes, recv_sizes)
        # Each received pair is a token routed to one local expert.
        y = self._experts(recv_x, recv_w[:, None], (recv_ids - self.expert_start)[:, None])
        back = ep.all_to_all(y, recv_sizes, send_sizes)
        out = torch.zeros_like(x_mine).index_add_(0, tokens, back)
        return ep.all_gather(out, dim=0, sizes=token_sizes)


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated) + ``experts``; Qwen2-MoE adds a ``shared_expert`` MLP every
    token goes through, scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, gate: nn.Module, experts: FusedMoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x, ctx)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def build_sparse_moe_block(hidden_size: int, num_experts: int, top_k: int,
                           intermediate_size: int, *, renormalize: bool, dtype: torch.dtype,
                           quant_config: Any, prefix: str, shared_expert: nn.Module | None = None,
                           shared_expert_gate: bool = False,
                           part_names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                               "down_proj")) -> SparseMoeBlock:
    """The router (``{prefix}.gate``, never quantized: it is tiny and routing must be exact)
    and the experts (``part_names``: the checkpoint's names of an expert's gate, up and down
    projections, which a quantized checkpoint's exclusions match); optionally a shared expert
    and its one-output sigmoid gate."""
    from bladellm.model.layers.linear import ReplicatedLinear

    gate = ReplicatedLinear(hidden_size, num_experts, bias=False, params_dtype=dtype,
                            prefix=f"{prefix}.gate")
    experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                       renormalize=renormalize, params_dtype=dtype, quant_config=quant_config,
                       prefix=f"{prefix}.experts", part_names=part_names)
    shared_gate = ReplicatedLinear(hidden_size, 1, bias=False, params_dtype=dtype,
                                   prefix=f"{prefix}.shared_expert_gate") \
        if shared_expert_gate else None
    return SparseMoeBlock(gate, experts, shared_expert, shared_gate)


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    """The layers with stacked float experts (quantized ones hold their kernels' forms from
    the loader already)."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.quant_method is None]


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(\w+)$")


class ExpertWeights:
    """Routes a checkpoint's per-expert tensors (``<block>.experts.{e}.<part>.weight``) into
    the ``FusedMoE`` modules of ``model``; ``route(weights)`` yields every other tensor (and
    expert tensors of layers this process does not hold: another pipeline stage's, which the
    model's loader skips). ``loaded()``: the stacked parameters that got every expert this rank
    holds."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name)
            module = self.modules.get(match.group(1)) if match else None
            if module is None or match.group(3) not in EXPERT_PARTS:
                yield name, tensor
                continue
            which, part = EXPERT_PARTS[match.group(3)]
            try:
                module.load_expert(which, int(match.group(2)), part, tensor, match.group(4))
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: {e}") from e

    def loaded(self) -> set[str]:
        return {f"{name}.{param}" for name, m in self.modules.items()
                for param in m.loaded_names()}


__all__ = ["EXPERT_PARTS", "ExpertWeights", "FusedMoE", "SparseMoeBlock",
           "build_sparse_moe_block", "moe_layers"]
