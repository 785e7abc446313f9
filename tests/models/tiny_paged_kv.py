"""A tiny paged-KV harness for model tests: allocates blocks per request and builds the
``AttentionMetadata`` the model runner would (decodes first, then prefill chunks)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from bladellm.attention.backend import AttentionContext, AttentionMetadata


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

    def step(self, seqs: list[Seq], query_lens: list[int]) -> tuple[AttentionContext, torch.Tensor]:
        """Metadata for one step where seqs[i] computes its next query_lens[i] tokens.
        Returns (ctx, positions). Callers order decodes (query_len 1) first."""
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
                              dtype=torch.int64)
        num_decodes = 0
        while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
            num_decodes += 1
        md = AttentionMetadata(
            num_reqs=len(seqs), num_decodes=num_decodes, num_actual_tokens=qsl[-1],
            query_start_loc=torch.tensor(qsl, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, max_seq_len=max(seq_lens))
        return AttentionContext(md, self.caches), torch.tensor(positions, dtype=torch.int64)
