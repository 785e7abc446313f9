"""The paged KV cache's memory layout, shared by the target model's runner and the sps draft:
one tensor per layer, ``[2 (K, V), num_blocks, block_size, num_kv_heads, row]``.

``row`` is ``head_dim`` elements of the model dtype, or with ``--kv_cache_quant int8``
``head_dim`` int8 values followed by the row's fp32 scale (``head_dim + 4`` bytes; see
``kernels/kv_int8.py``). Block counts are sized from these true bytes, scales included.
"""

from __future__ import annotations

import torch

from bladellm.kernels import kv_int8


def kv_cache_dtype(dtype: torch.dtype, quant: str) -> torch.dtype:
    return torch.int8 if quant == "int8" else dtype


def kv_row_elems(head_dim: int, quant: str) -> int:
    """Elements of one (token, kv head) row of K or V."""
    if quant == "int8":
        kv_int8.check_head_dim(head_dim)
        return kv_int8.row_width(head_dim)
    return head_dim


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, quant: str = "no_quant") -> int:
    """Bytes one block id takes across all layers (K and V, int8 scales included)."""
    elem = torch.tensor([], dtype=kv_cache_dtype(dtype, quant)).element_size()
    return 2 * num_layers * block_size * num_kv_heads * kv_row_elems(head_dim, quant) * elem


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device | str,
                       quant: str = "no_quant") -> list[torch.Tensor]:
    """The per-layer KV tensors. Uninitialised on purpose: attention reads only positions
    < seq_len, which were written first, so no slot is read before it is stored. Zero-filling
    GiBs would lengthen every start (docs/cpu.md), and untouched pages stay uncommitted until a
    request reaches them."""
    shape = (2, num_blocks, block_size, num_kv_heads, kv_row_elems(head_dim, quant))
    return [torch.empty(shape, dtype=kv_cache_dtype(dtype, quant), device=device)
            for _ in range(num_layers)]
