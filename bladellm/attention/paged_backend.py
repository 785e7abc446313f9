"""Paged attention over the flat batch: store this step's K/V, then one kernel call for all
requests, whatever their query lengths (prefill chunks, decodes, verification tokens).

The kernels come from ``bladellm.kernels``: the set the worker resolved from ``--kernels``
(compiled CPU, reference or Triton), or the plain-PyTorch reference twins (``--attn_cls torch``).
All read the KV blocks in place.
"""

from __future__ import annotations

from typing import Any

import torch

from bladellm.attention import tree
from bladellm.attention.backend import PLAIN, AttentionBackend, AttentionFeatures, \
    AttentionMetadata


class PagedAttentionBackend(AttentionBackend):
    def __init__(self, kernels: Any, name: str) -> None:
        self.kernels = kernels  # any object with reshape_and_cache and paged_attention
        self.name = name

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, features: AttentionFeatures = PLAIN) -> torch.Tensor:
        n = metadata.num_actual_tokens
        # Plain attention calls the kernels exactly as before the features existed.
        extra = {} if features.is_plain else features.kwargs()
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.kernels.reshape_and_cache(key[:n], value[:n], k_cache, v_cache,
                                       metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if n < query.shape[0]:
            out[n:].zero_()  # padding tokens (e.g. a CUDA-graph bucket) get a defined output
        self.kernels.paged_attention(out[:n], query[:n], k_cache, v_cache,
                                     metadata.block_tables, metadata.query_start_loc,
                                     metadata.seq_lens, scale,
                                     # host ints: no kernel set reads the device tensors back
                                     max_query_len=metadata.max_query_len,
                                     max_seq_len=metadata.max_seq_len, **extra)
        if metadata.tree is not None:
            # The compiled kernels take no custom mask: tree tokens (look_ahead) go through the
            # PyTorch path (attention/tree.py), overwriting the rows the causal kernel computed.
            group = query.shape[1] // k_cache.shape[2]
            for idx, (req, start, size, ctx_len, mask) in enumerate(metadata.tree.entries):
                out[start:start + size] = tree.tree_attention(
                    query[start:start + size], key[start:start + size],
                    value[start:start + size], k_cache, v_cache, metadata.block_tables[req],
                    ctx_len, metadata.tree.bias(idx, group), scale, **extra).to(out.dtype)
        return out
