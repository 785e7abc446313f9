"""How tensor parallelism of any degree ``T`` splits a model: uneven shards, no padding.

Pure functions, no process group: the layers call them with ``(rank, size)`` of their TP group.

* ``split_evenly(total, parts)``: sizes that differ by at most 1, larger ones first. Used for the
  MLP intermediate size (gate and up columns, the matching down_proj rows) and the vocabulary
  (embedding rows, LM head columns).
* ``attention_partition(H, K, T, rank)``: which query and KV heads a rank holds. With ``T <= K``
  the K KV groups (each a KV head and its ``g = H // K`` query heads) are split over the ranks,
  whole groups per rank. With ``T > K`` the ranks are split over the groups; every rank of group
  ``i`` holds KV head ``i`` (replicated) and a share of its ``g`` query heads. Either way query
  head ``j`` of a rank uses local KV head ``j // (num_q_heads // num_kv_heads)``: the usual GQA
  mapping, so the attention kernels need no change. Ranks may differ in their head counts (and so
  in their KV cache size per block).
"""

from __future__ import annotations

from typing import NamedTuple


def split_evenly(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``, differing by at most 1, larger ones first."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if total < 0:
        raise ValueError(f"cannot split a negative total {total}")
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def shard_range(sizes: list[int], index: int) -> tuple[int, int]:
    """(start, size) of shard ``index`` when shards of ``sizes`` are laid out in order."""
    return sum(sizes[:index]), sizes[index]


def even_shard(total: int, parts: int, index: int, what: str = "size") -> tuple[int, int]:
    """(start, size) of shard ``index`` of ``split_evenly(total, parts)``; every shard must be
    non-empty (``what`` names the split quantity in the error)."""
    if total < parts:
        raise ValueError(f"{what} {total} is smaller than tensor_parallel_size {parts}: "
                         f"some rank would hold nothing")
    return shard_range(split_evenly(total, parts), index)


class AttentionShard(NamedTuple):
    """One rank's heads: query heads ``[q_head_start, q_head_start + num_q_heads)`` and KV heads
    ``[kv_head_start, kv_head_start + num_kv_heads)`` of the full model."""

    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int


def attention_partitions(num_heads: int, num_kv_heads: int, tp_size: int) -> list[AttentionShard]:
    """Every rank's ``AttentionShard`` (see the module docstring for the rule)."""
    H, K, T = num_heads, num_kv_heads, tp_size
    if H < 1 or K < 1 or T < 1:
        raise ValueError(f"invalid attention partition: num_attention_heads {H}, "
                         f"num_key_value_heads {K}, tensor_parallel_size {T}")
    if H % K:
        raise ValueError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {K}")
    g = H // K
    shards: list[AttentionShard] = []
    if T <= K:
        kv_start = 0
        for groups in split_evenly(K, T):
            shards.append(AttentionShard(kv_start * g, groups * g, kv_start, groups))
            kv_start += groups
        return shards
    if T > H:
        raise ValueError(f"tensor_parallel_size {T} is larger than num_attention_heads {H}: "
                         f"some rank would hold no query head")
    for kv_head, ranks in enumerate(split_evenly(T, K)):
        # ranks <= ceil(T / K) <= g because T <= H = K * g, so no rank gets 0 query heads.
        q_start = kv_head * g
        for n in split_evenly(g, ranks):
            shards.append(AttentionShard(q_start, n, kv_head, 1))
            q_start += n
    assert len(shards) == T and all(s.num_q_heads > 0 for s in shards)
    return shards


def attention_partition(num_heads: int, num_kv_heads: int, tp_size: int,
                        rank: int) -> AttentionShard:
    """``(q_head_start, num_q_heads, kv_head_start, num_kv_heads)`` of TP rank ``rank``."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tensor_parallel_size {tp_size}")
    return attention_partitions(num_heads, num_kv_heads, tp_size)[rank]


__all__ = ["AttentionShard", "attention_partition", "attention_partitions", "even_shard",
           "shard_range", "split_evenly"]


def pipeline_stages(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` decoder layers of each pipeline stage: contiguous runs whose lengths
    differ by at most 1, longer ones first (the last stage also runs the final norm, the LM head
    and the sampler, so it is the one that gets fewer layers). Every stage holds a layer."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} is larger than the model's "
                         f"{num_layers} layers: some stage would hold no layer")
    stages, start = [], 0
    for n in split_evenly(num_layers, pp_size):
        stages.append((start, start + n))
        start += n
    return stages
