"""Plain-PyTorch paged attention: the CPU path and the reference for every other backend.

Per step: (1) scatter this step's K/V into the paged cache at ``slot_mapping``; (2) the first
``num_decodes`` requests (one query token each) run as ONE batched SDPA over their gathered
blocks; (3) each remaining request (a prefill chunk, maybe after a cached prefix) runs one SDPA
whose queries are the last ``query_len`` of its ``seq_len`` positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bladellm.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float) -> torch.Tensor:
        n = metadata.num_actual_tokens
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv_cache(key[:n], value[:n], k_cache, v_cache, metadata.slot_mapping[:n])

        out = torch.empty_like(query)
        if n < query.shape[0]:
            out[n:].zero_()  # padding tokens (e.g. a CUDA-graph bucket) get a defined output
        nd = metadata.num_decodes
        if nd > 0:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, metadata, scale)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(nd, metadata.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill(query[start:end], key[start:end], value[start:end],
                                           k_cache, v_cache, metadata.block_tables[i],
                                           seq_lens[i], scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [B, nh, d] -> [B, nh, d]; one query per request, keys masked beyond seq_len."""
        nd = q.shape[0]
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        max_len = max(metadata.seq_lens_cpu[:nd])
        num_blocks = -(-max_len // block_size)  # gather only the blocks the longest one needs
        blocks = metadata.block_tables[:nd, :num_blocks].reshape(-1)
        length = num_blocks * block_size
        k = _gather(k_cache, blocks).view(nd, length, num_kv_heads, head_dim).transpose(1, 2)
        v = _gather(v_cache, blocks).view(nd, length, num_kv_heads, head_dim).transpose(1, 2)
        # A single query needs no causal mask, so the query heads sharing a KV head can ride
        # in the "query length" axis: [B, kvh, group, d] against [B, kvh, L, d], no K/V expand.
        group = q.shape[1] // num_kv_heads
        qg = q.view(nd, num_kv_heads, group, head_dim)
        positions = torch.arange(length, device=q.device)
        mask = (positions[None, :] < metadata.seq_lens[:nd, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(nd, num_kv_heads * group, head_dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int, scale: float) -> torch.Tensor:
        """q [Q, nh, d] are positions ``seq_len - Q .. seq_len - 1`` of one request."""
        query_len = q.shape[0]
        num_kv_heads, head_dim = k_cache.shape[2:]
        gqa = q.shape[1] != num_kv_heads
        # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to the slow math kernel.
        qt = q.transpose(0, 1)[None]
        if query_len == seq_len:  # no cached prefix: this step's K/V are the whole context
            out = F.scaled_dot_product_attention(
                qt, k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None], is_causal=True,
                scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        block_size = k_cache.shape[1]
        table = block_table[:-(-seq_len // block_size)]
        k = _gather(k_cache, table).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = _gather(v_cache, table).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=q.device)[:, None] + offset
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qt, k[None], v[None], attn_mask=mask, scale=scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    # index_select copies whole blocks; several times faster on CPU than advanced indexing.
    return cache.index_select(0, blocks)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store K/V [N, kvh, d] at flat slots of the [num_blocks, block_size, kvh, d] caches."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
