"""Attention backend interface and the per-step attention metadata.

One flat batch per step, no padding and no ordering rule: request i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` (q_i >= 1 of them: a prefill chunk, one decode token,
or 1 + k tokens to verify) and its context is ``seq_lens[i]`` tokens long *including* them, so
its queries sit at positions ``seq_lens[i] - q_i .. seq_lens[i] - 1`` and attend causally.
Decode is not a special case: it is q_i = 1.

KV cache per layer: a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
Token t of request i lives in slot ``block_tables[i][t // block_size] * block_size + t %
block_size``; ``slot_mapping`` gives that slot for each new token of the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from bladellm.attention.tree import tree_bias


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32; entries past a row's end: 0
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    # Host copies (numpy views of the runner's buffers) for backends that plan on the host.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    # Requests whose last query tokens form a tree (look_ahead) rather than a causal run.
    tree: "TreeAttention | None" = None

    @classmethod
    def single_prefill(cls, num_tokens: int, block_size: int) -> "AttentionMetadata":
        """One request prefilling ``num_tokens`` from position 0 into blocks 0, 1, ... of a
        cache of its own (a scratch cache; no scheduler involved)."""
        qsl = np.array([0, num_tokens], dtype=np.int32)
        seq_lens = np.array([num_tokens], dtype=np.int32)
        num_blocks = -(-num_tokens // block_size)
        return cls(num_reqs=1, num_actual_tokens=num_tokens, max_query_len=num_tokens,
                   max_seq_len=num_tokens, query_start_loc=torch.from_numpy(qsl),
                   seq_lens=torch.from_numpy(seq_lens),
                   block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
                   slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
                   query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


@dataclass
class TreeAttention:
    """Masked query tokens: entries ``(req, start, size, ctx_len, mask)``. Request ``req``'s
    flat tokens ``start:start+size`` see cache positions ``0..ctx_len-1`` and each other as the
    bool ``mask [size, size]`` says (row attends to column); their own K/V come from this step's
    tensors, not the cache."""

    entries: list
    # Additive masks (attention/tree.py), built on first use and shared by every layer.
    _biases: dict = field(default_factory=dict, repr=False)

    def bias(self, index: int, group: int) -> torch.Tensor:
        if index not in self._biases:
            _, _, _, ctx_len, mask = self.entries[index]
            self._biases[index] = tree_bias(mask, ctx_len, group)
        return self._biases[index]


@dataclass(frozen=True)
class AttentionFeatures:
    """One layer's attention features, fixed at model build (semantics:
    ``kernels.ref.attention_scores``). All None: plain causal attention."""

    sliding_window: int | None = None  # a query sees its last ``sliding_window`` keys
    alibi_slopes: torch.Tensor | None = None  # [this rank's query heads] fp32
    soft_cap: float | None = None  # attention logits -> soft_cap * tanh(logits / soft_cap)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.soft_cap is not None and not self.soft_cap > 0:
            raise ValueError(f"attention soft cap must be > 0, got {self.soft_cap}")

    def kwargs(self) -> dict:
        """Keyword arguments of the kernels' ``paged_attention`` / ``tree_attention``."""
        return dict(sliding_window=self.sliding_window, alibi_slopes=self.alibi_slopes,
                    soft_cap=self.soft_cap)

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.alibi_slopes is None \
            and self.soft_cap is None


PLAIN = AttentionFeatures()


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache and computes attention for the flat batch."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        features: AttentionFeatures = PLAIN,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
