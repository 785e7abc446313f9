"""Paged-attention batches laid out as the engine lays them out, for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bladellm.kernels import Kernels


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, nh, d], a strided view into a fused qkv tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32, shuffled block ids, padded with 0
    query_start_loc: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32

    def run(self, kernels: Kernels, scale: float) -> torch.Tensor:
        out = torch.empty(self.query.shape, dtype=self.query.dtype)
        kernels.paged_attention(out, self.query, self.k_cache, self.v_cache, self.block_tables,
                                self.query_start_loc, self.seq_lens, scale)
        return out


def make_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> PagedBatch:
    """Requests with the given query and context lengths; block ids are a random permutation
    (never contiguous, never in order) and the cache holds spare blocks of garbage."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = ids[used:used + n]
        used += n
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=g)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(qkv.to(dtype)[:, :num_heads], kv[0], kv[1], tables,
                      torch.tensor(starts, dtype=torch.int32),
                      torch.tensor(seq_lens, dtype=torch.int32))


def share_prefix(batch: PagedBatch, members: list[int], keys: int, block_size: int) -> None:
    """Point the first ``keys // block_size`` blocks of every member at the first member's
    blocks, as a prompt-cache hit on a common prefix leaves them (capped at each member's own
    block count)."""
    first = batch.block_tables[members[0]]
    for r in members[1:]:
        n = min(keys // block_size, -(-int(batch.seq_lens[r]) // block_size))
        batch.block_tables[r, :n] = first[:n]
