"""The paged KV cache's memory layout, shared by the target model's runner and the sps draft:
one tensor per layer, ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block id takes across all layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[torch.Tensor]:
    """The per-layer KV tensors. Uninitialised on purpose: attention reads only positions
    < seq_len, which were written first, so no slot is read before it is stored. Zero-filling
    GiBs cost ~1.5 s per GiB of start-up (8.8 s for the demo model's auto-sized pool), and
    untouched pages stay uncommitted until a request reaches them."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
