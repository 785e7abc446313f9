"""Tensor-parallel linear layers (nano-vllm / vLLM style).

Each layer allocates only its own shard and gives every parameter a
``weight_loader(param, loaded_weight, shard_id=None)`` that narrows the full checkpoint tensor to
that shard, so the loader never needs to know about TP.

The matmul goes through ``layer.quant_method.apply(layer, x, bias)``: quantization swaps the
method (its ``create_weights`` registers e.g. qweight/scales instead of ``weight``).
LoRA hook: every ``forward(x, ctx)`` receives the step's ``ForwardContext``; a LoRA-wrapped layer
(``bladellm/lora``) wraps a base layer and adds ``x @ A[ctx.lora...] @ B[...]`` per token to
``base.quant_method.apply(base, x, bias)``; ``output_partition_sizes`` tells it where the q/k/v or
gate/up slices of a fused output start. Base layers ignore ``ctx``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from bladellm.model.utils import (copy_checked, get_tp_rank_and_size, set_weight_attrs,
                                  tp_all_gather, tp_all_reduce)


class LinearMethodBase(ABC):
    """How a linear layer stores its weights and runs its matmul."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        ...


class UnquantizedLinearMethod(LinearMethodBase):
    """``x @ weight.T + bias`` through ``Kernels.linear``: the compiled small-M kernel at decode
    sizes (fp32 accumulation, within GEMM rounding of F.linear), F.linear otherwise."""

    def __init__(self) -> None:
        from bladellm.kernels import get_kernels

        self.kernels = get_kernels()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after every weight is loaded: the kernels' load-time form of the weight
        (None where the kernels need none; ``apply`` works either way)."""
        layer.packed_weight = self.kernels.pack_linear_weight(layer.weight)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.linear(x, layer.weight, bias, getattr(layer, "packed_weight", None))


def _get_quant_method(quant_config: Any, layer: nn.Module, prefix: str) -> LinearMethodBase:
    if quant_config is not None:
        method = quant_config.get_quant_method(layer, prefix)
        if method is not None:
            return method
    return UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """Common part: TP info, quant method, optional bias of ``bias_size`` rows."""

    def __init__(self, input_size: int, output_size: int, *, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.quant_method = _get_quant_method(quant_config, self, prefix)

    def _create(self, input_size_per_partition: int, output_partition_sizes: list[int],
                bias: bool, bias_loader: Any) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                         self.params_dtype, self.weight_loader)
        if bias:
            b = nn.Parameter(torch.empty(sum(output_partition_sizes), dtype=self.params_dtype),
                             requires_grad=False)
            set_weight_attrs(b, {"output_dim": 0, "weight_loader": bias_loader})
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 params_dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix)
        self._create(input_size, [output_size], bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; ``gather_output`` concatenates them again."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 gather_output: bool = False, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "",
                 output_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix)
        self.gather_output = gather_output
        sizes = output_sizes if output_sizes is not None else [output_size]
        for size in sizes:
            if size % self.tp_size:
                raise ValueError(f"{prefix}: output size {size} is not divisible by "
                                 f"tensor_parallel_size {self.tp_size}")
        self._create(input_size, [s // self.tp_size for s in sizes], bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        shard = param.data.size(param.output_dim)
        copy_checked(param.data, _shard(loaded_weight, param.output_dim, self.tp_rank, shard,
                                        self.tp_size))

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return tp_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_up_proj); shard_id = index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, *,
                 params_dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix, output_sizes=output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            return super().weight_loader(param, loaded_weight)
        sizes = self.output_partition_sizes
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        dim = param.output_dim
        copy_checked(param.data.narrow(dim, offset, size),
                     _shard(loaded_weight, dim, self.tp_rank, size, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard_id in {"q", "k", "v"}.

    With more ranks than KV heads, each KV head is replicated on ``tp_size // total_kv`` ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, *, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "") -> None:
        _, tp_size = get_tp_rank_and_size()
        if total_num_heads % tp_size:
            raise ValueError(f"num_attention_heads {total_num_heads} is not divisible by "
                             f"tensor_parallel_size {tp_size}")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of "
                                 f"num_key_value_heads {total_num_kv_heads}")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            if total_num_kv_heads % tp_size:
                raise ValueError(f"num_key_value_heads {total_num_kv_heads} is not divisible "
                                 f"by tensor_parallel_size {tp_size}")
            self.num_kv_heads, self.num_kv_head_replicas = total_num_kv_heads // tp_size, 1
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        q_size = total_num_heads * head_size
        # Sizes as if unsharded, so ColumnParallelLinear's division yields the per-rank sizes.
        kv_size = self.num_kv_heads * head_size * tp_size
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix,
                         output_sizes=[q_size, kv_size, kv_size])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("fused qkv checkpoint tensors are not supported; expected separate "
                             "q_proj/k_proj/v_proj")
        q, kv, _ = self.output_partition_sizes
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        kv_shards = self.tp_size // self.num_kv_head_replicas
        offset, size, rank, num_shards = {
            "q": (0, q, self.tp_rank, self.tp_size),
            "k": (q, kv, kv_rank, kv_shards),
            "v": (q + kv, kv, kv_rank, kv_shards)}[shard_id]
        dim = param.output_dim
        copy_checked(param.data.narrow(dim, offset, size),
                     _shard(loaded_weight, dim, rank, size, num_shards))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, bias added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 reduce_results: bool = True, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix)
        if input_size % self.tp_size:
            raise ValueError(f"{prefix}: input size {input_size} is not divisible by "
                             f"tensor_parallel_size {self.tp_size}")
        self.reduce_results = reduce_results
        self._create(input_size // self.tp_size, [output_size], bias, _full_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        shard = param.data.size(param.input_dim)
        copy_checked(param.data, _shard(loaded_weight, param.input_dim, self.tp_rank, shard,
                                        self.tp_size))

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        # Bias only on rank 0 so the all-reduce adds it exactly once.
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return tp_all_reduce(y) if self.reduce_results and self.tp_size > 1 else y


def _full_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    copy_checked(param.data, loaded_weight)


def _shard(t: torch.Tensor, dim: int, rank: int, size: int, num_shards: int) -> torch.Tensor:
    """Rank's slice of a full checkpoint tensor; a wrong full size is a shape mismatch."""
    if t.dim() <= dim or t.size(dim) != size * num_shards:
        raise ValueError(f"shape mismatch: checkpoint tensor has shape {tuple(t.shape)}, "
                         f"expected size {size * num_shards} in dim {dim}")
    return t.narrow(dim, rank * size, size)
