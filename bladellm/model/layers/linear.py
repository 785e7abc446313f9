"""Tensor-parallel linear layers (nano-vllm / vLLM style).

Each layer allocates only its own shard and gives every parameter a
``weight_loader(param, loaded_weight, shard_id=None)`` that narrows the full checkpoint tensor to
that shard, so the loader never needs to know about TP. Shards may be uneven (any
tensor_parallel_size; ``bladellm.distributed.partition``): column-parallel layers know each output's
``(start, size)`` (``output_shards``), row-parallel ones their input ``(start, size)``.

The matmul goes through ``layer.quant_method.apply(layer, x, bias)`` (the interface,
``LinearMethodBase``, lives in ``bladellm.quantization``): quantization swaps the method (its
``create_weights`` registers e.g. qweight/scales instead of ``weight``).
LoRA hook: every ``forward(x, ctx)`` receives the step's ``ForwardContext``; a LoRA-wrapped layer
(``bladellm/lora``) wraps a base layer and adds ``x @ A[ctx.lora...] @ B[...]`` per token to
``base.quant_method.apply(base, x, bias)``; ``output_partition_sizes`` tells it where the q/k/v or
gate/up slices of a fused output start. Base layers ignore ``ctx``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bladellm.distributed.partition import attention_partition, even_shard, split_evenly
from bladellm.kernels import Kernels
from bladellm.kernels.scope import kernels_for
from bladellm.model.utils import copy_checked, get_tp_rank_and_size, tp_all_gather, tp_all_reduce
from bladellm.quantization.linear_method import LinearMethodBase
from bladellm.quantization.weight_attrs import set_weight_attrs


class UnquantizedLinearMethod(LinearMethodBase):
    """``x @ weight.T + bias`` through ``Kernels.linear``: the compiled small-M kernel at decode
    sizes (fp32 accumulation, within GEMM rounding of F.linear), F.linear otherwise."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

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


def _get_quant_method(quant_config: Any, layer: "LinearBase", prefix: str) -> LinearMethodBase:
    if quant_config is not None:
        method = quant_config.get_quant_method(layer, prefix)
        if method is not None:
            return method
    return UnquantizedLinearMethod(layer.kernels)


class LinearBase(nn.Module):
    """Common part: TP info, quant method, optional bias over this rank's outputs, and the kernel
    set of the model being built (``kernels.scope``), which the linear methods run on."""

    def __init__(self, input_size: int, output_size: int, *, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.kernels = kernels_for(prefix or type(self).__name__)
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
    """Output features split across ranks; ``gather_output`` concatenates them again.

    Each logical output (``output_sizes``, default ``[output_size]``) is split on its own:
    ``output_shards`` gives this rank's ``(start, size)`` in each (default ``split_evenly`` over
    the ranks; QKVParallelLinear passes its head ranges, where KV rows may be replicated).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 gather_output: bool = False, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "",
                 output_sizes: list[int] | None = None,
                 output_shards: list[tuple[int, int]] | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix)
        self.gather_output = gather_output
        sizes = output_sizes if output_sizes is not None else [output_size]
        if output_shards is None:
            output_shards = [even_shard(size, self.tp_size, self.tp_rank,
                                        f"{prefix or 'column-parallel'} output size")
                             for size in sizes]
        if len(output_shards) != len(sizes):
            raise ValueError(f"{prefix}: {len(output_shards)} output shards for "
                             f"{len(sizes)} outputs")
        if gather_output and len(sizes) > 1 and self.tp_size > 1:
            raise ValueError(f"{prefix}: gather_output needs a single output")
        self.output_full_sizes = list(sizes)
        self.output_shards = [tuple(s) for s in output_shards]
        self._create(input_size, [size for _, size in self.output_shards], bias,
                     self.weight_loader)

    def _load_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, index: int) -> None:
        """Narrow the full checkpoint tensor of output ``index`` into its place in ``param``."""
        dim = param.output_dim
        offset = sum(size for _, size in self.output_shards[:index])
        start, size = self.output_shards[index]
        full = self.output_full_sizes[index]
        if loaded_weight.dim() <= dim or loaded_weight.size(dim) != full:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, expected size {full} in dim {dim}")
        copy_checked(param.data.narrow(dim, offset, size), loaded_weight.narrow(dim, start, size))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if len(self.output_shards) != 1:
            raise ValueError(f"{self.prefix}: a fused checkpoint tensor needs a shard id")
        self._load_shard(param, loaded_weight, 0)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = tp_all_gather(y, -1, split_evenly(self.output_size, self.tp_size))
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_up_proj); shard_id = index.
    Each output is split on its own (``split_evenly``), so gate and up get the same columns."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, *,
                 params_dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix, output_sizes=output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor: split it into its outputs
            dim = param.output_dim
            if loaded_weight.dim() <= dim or \
                    loaded_weight.size(dim) != sum(self.output_full_sizes):
                raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                                 f"{tuple(loaded_weight.shape)}, expected size "
                                 f"{sum(self.output_full_sizes)} in dim {dim}")
            for i, part in enumerate(loaded_weight.split(self.output_full_sizes, dim=dim)):
                self._load_shard(param, part, i)
            return
        self._load_shard(param, loaded_weight, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard_id 0, 1, 2 (or "q", "k", "v").

    Heads are split by ``attention_partition`` (any tensor_parallel_size up to the number of
    query heads): ``num_heads`` / ``num_kv_heads`` are this rank's, starting at the full model's
    ``q_head_start`` / ``kv_head_start``; with more ranks than KV heads each rank holds one KV
    head, replicated on the ranks sharing it.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, *, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "") -> None:
        tp_rank, tp_size = get_tp_rank_and_size()
        part = attention_partition(total_num_heads, total_num_kv_heads, tp_size, tp_rank)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.q_head_start, self.num_heads = part.q_head_start, part.num_q_heads
        self.kv_head_start, self.num_kv_heads = part.kv_head_start, part.num_kv_heads
        q_size, kv_size = total_num_heads * head_size, total_num_kv_heads * head_size
        q_shard = (part.q_head_start * head_size, part.num_q_heads * head_size)
        kv_shard = (part.kv_head_start * head_size, part.num_kv_heads * head_size)
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix,
                         output_sizes=[q_size, kv_size, kv_size],
                         output_shards=[q_shard, kv_shard, kv_shard])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("fused qkv checkpoint tensors are not supported; expected separate "
                             "q_proj/k_proj/v_proj")
        # The loader passes the part's index (0, 1, 2); "q" / "k" / "v" name the same parts.
        index = {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id
        self._load_shard(param, loaded_weight, index)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced, bias added once.

    ``input_partition`` is this rank's ``(start, size)`` of the input features: the layer after
    a column-parallel one must take exactly that one's shard (o_proj: the rank's query heads,
    down_proj: its intermediate columns). Default: ``split_evenly`` over the ranks.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 reduce_results: bool = True, params_dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "",
                 input_partition: tuple[int, int] | None = None) -> None:
        super().__init__(input_size, output_size, params_dtype=params_dtype,
                         quant_config=quant_config, prefix=prefix)
        if input_partition is None:
            input_partition = even_shard(input_size, self.tp_size, self.tp_rank,
                                         f"{prefix or 'row-parallel'} input size")
        start, size = input_partition
        if start < 0 or size < 0 or start + size > input_size:
            raise ValueError(f"{prefix}: input partition {input_partition} outside "
                             f"input size {input_size}")
        self.input_start = start
        self.reduce_results = reduce_results
        self._create(size, [output_size], bias, _full_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        dim = param.input_dim
        if loaded_weight.dim() <= dim or loaded_weight.size(dim) != self.input_size:
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, expected size {self.input_size} "
                             f"in dim {dim}")
        copy_checked(param.data, loaded_weight.narrow(dim, self.input_start,
                                                      self.input_size_per_partition))

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        # Bias only on rank 0 so the all-reduce adds it exactly once.
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return tp_all_reduce(y) if self.reduce_results and self.tp_size > 1 else y


def _full_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    copy_checked(param.data, loaded_weight)
