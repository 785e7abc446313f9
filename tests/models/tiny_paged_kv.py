"""A tiny paged-KV harness for model tests: allocates blocks per request and builds the
``AttentionMetadata`` the model runner would (any order, any query length per request)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from bladellm.attention.backend import AttentionMetadata
from bladellm.model.forward_context import ForwardContext


@dataclass
class Seq:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedKV:
    def __init__(self, spec, num_blocks: int, block_size: int, dtype=torch.float32, seed=0):
        self.block_size = block_size
        self.caches = [torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                                   dtype=dtype) for _ in range(spec.num_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous blocks on purpose

    def step(self, seqs: list[Seq], query_lens: list[int]) -> tuple[ForwardContext, torch.Tensor]:
        """Metadata for one step where seqs[i] computes its next query_lens[i] tokens.
        Returns (ctx, positions)."""
        slots, positions, qsl, seq_lens = [], [], [0], []
        for seq, q in zip(seqs, query_lens):
            start, end = seq.num_computed, seq.num_computed + q
            while len(seq.block_table) * self.block_size < end:
                seq.block_table.append(self.free.pop())
            for pos in range(start, end):
                blk = seq.block_table[pos // self.block_size]
                slots.append(blk * self.block_size + pos % self.block_size)
                positions.append(pos)
            qsl.append(qsl[-1] + q)
            seq_lens.append(end)
            seq.num_computed = end
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                              dtype=torch.int32)
        qsl_np, seq_lens_np = np.array(qsl, dtype=np.int32), np.array(seq_lens, dtype=np.int32)
        md = AttentionMetadata(
            num_reqs=len(seqs), num_actual_tokens=qsl[-1], max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), query_start_loc=torch.from_numpy(qsl_np),
            seq_lens=torch.from_numpy(seq_lens_np), block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl_np,
            seq_lens_cpu=seq_lens_np)
        return ForwardContext(md, self.caches), torch.tensor(positions, dtype=torch.int64)
