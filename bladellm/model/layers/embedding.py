"""Vocab-parallel token embedding and LM head.

Each rank holds its ``split_evenly(vocab, tp)`` rows (uneven shards, no padding): ids outside the
shard are masked to row 0 and zeroed, and the all-reduce assembles the full embedding. The LM head
computes its shard's logit columns and all-gathers them with the same uneven sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bladellm.distributed.partition import even_shard, split_evenly
from bladellm.kernels.scope import kernels_for
from bladellm.model.utils import copy_checked, get_tp_rank_and_size, tp_all_gather, tp_all_reduce
from bladellm.quantization.weight_attrs import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype,
                 prefix: str = "") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank_and_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.num_embeddings_per_partition = even_shard(
            num_embeddings, self.tp_size, self.tp_rank, "vocab_size")
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.shard_sizes = split_evenly(num_embeddings, self.tp_size)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
            requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, expected "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        copy_checked(param.data, loaded_weight[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; ``tie_to`` shares the embedding's weight."""

    # The kernels' load-time form of the weight (``process_weights_after_loading``), or None.
    packed_weight: object | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype,
                 bias: bool = False, prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, prefix=prefix)
        self.kernels = kernels_for(prefix or "ParallelLMHead")
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition,
                                                 dtype=params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.bias_loader})
        else:
            self.register_parameter("bias", None)

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                    shard_id: Any = None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings,):
            raise ValueError(f"shape mismatch: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, expected {(self.num_embeddings,)}")
        copy_checked(param.data, loaded_weight[self.vocab_start:self.vocab_end])

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through compute_logits, not called")

    def process_weights_after_loading(self) -> None:
        """Once, after every weight is loaded (and tied): what the linear layers keep too
        (``UnquantizedLinearMethod.process_weights_after_loading``)."""
        self.packed_weight = self.kernels.pack_linear_weight(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab] (matmul in the model dtype, like transformers)."""
        logits = self.kernels.linear(hidden, self.weight, self.bias, self.packed_weight)
        if self.tp_size > 1:
            logits = tp_all_gather(logits, -1, self.shard_sizes)
        return logits[..., :self.num_embeddings].float()
