"""Attention backend interface.

The model runner builds one ``AttentionMetadata`` per step for the flat batch of tokens
(no padding): request i owns tokens ``query_start_loc[i]:query_start_loc[i+1]``. Requests are
ordered decodes first (``query_len == 1``), then prefill chunks, so a backend can run the first
``num_decodes`` requests as one batched decode and the rest per request.

KV cache per layer: a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
Token t of request i lives in slot ``block_table[i][pos // block_size] * block_size + pos %
block_size``; ``slot_mapping`` gives that slot for each new token of the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # the first num_decodes requests have query_len == 1
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64 (device)
    seq_lens: torch.Tensor  # [num_reqs] int64: context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    # Host copies for backends that loop over requests (the CPU path).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    # Backend-private data derived from the fields above (e.g. the CPU decode plan): built by the
    # first layer that needs it and reused by every later layer of the same step.
    backend_cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class AttentionContext:
    """What every attention layer needs for one forward pass; passed explicitly down the model."""

    metadata: AttentionMetadata | None  # None: a plain forward without KV cache (profiling)
    kv_caches: list[torch.Tensor]  # one per layer (index = layer index)


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
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
