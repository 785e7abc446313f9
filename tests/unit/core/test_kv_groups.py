"""Hybrid KV cache groups (core/kv_groups.py): the layout of layers into groups, and the KV
manager with a global and a window group: the window group frees its blocks past the window
while the global group keeps all; prompt-cache hits valid in every group; preemption sizing."""

from __future__ import annotations

import pytest

from bladellm.config import CacheConfig, SchedulerConfig
from bladellm.core.block_pool import NULL_BLOCK_ID
from bladellm.core.kv_cache_manager import KVCacheManager
from bladellm.core.kv_groups import engine_kv_cache_groups, kv_cache_groups
from bladellm.core.scheduler import Scheduler
from sched_utils import make_request

BS = 4
W = 2 * BS  # window


def test_one_kind_of_layer_is_one_group_of_every_layer():
    for windows, want in (([None] * 4, None), ([8] * 3, 8)):
        groups = kv_cache_groups(windows)
        assert groups.windows == [want] and groups.num_slots == len(windows)
        assert groups.groups[0].layers == tuple(range(len(windows)))
    # Hybrid off (--disable_hybrid_kv_cache): one group, every block kept with a global layer.
    assert kv_cache_groups([8, None, 8, None], hybrid=False).windows == [None]
    assert kv_cache_groups([8, 16], hybrid=False).windows == [16]  # the widest frees
    assert engine_kv_cache_groups([8, None], True, "normal").windows == [None]
    assert engine_kv_cache_groups([8, None], False, "normal").windows == [None, 8]
    # sps: the draft shares the one table and may attend wider: nothing freed, windows or not.
    for windows in ([8, 8], [8, None]):
        sps = engine_kv_cache_groups(windows, False, "sps")
        assert sps.windows == [None] and sps.groups[0].layers == (0, 1)


def test_mixed_layers_get_a_group_per_kind_and_run_of_slots():
    gemma2 = kv_cache_groups([8, None, 8, None])
    assert gemma2.windows == [None, 8] and gemma2.num_slots == 2
    assert [g.layers for g in gemma2.groups] == [(1, 3), (0, 2)]
    assert gemma2.placement() == {1: (0, 0), 3: (0, 1), 0: (1, 0), 2: (1, 1)}
    # Gemma 3 1B's pattern: 4 global, 22 local -> groups of 4, the last local one of 2.
    gemma3 = kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert gemma3.windows == [None] + [512] * 6 and gemma3.num_slots == 4
    assert [len(g.layers) for g in gemma3.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(gemma3.placement()) == list(range(26))
    # One group per distinct window.
    assert kv_cache_groups([8, 16, 8, 16]).windows == [8, 16]


def _hybrid(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, group_windows=[None, W])


def _run_prompt(kv: KVCacheManager, req_id: str, tokens: list[int], hits=(), num_hit=0):
    req = make_request(req_id, tokens, max_tokens=64)
    assert kv.allocate_slots(req, len(tokens) - num_hit, hits) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, req.num_computed_tokens)
    return req


def test_window_group_frees_blocks_while_the_global_group_keeps_all():
    """A request of 4x the window: the global group's table holds every block, the window
    group's only the window (and the block being written), the rest null and back in the pool."""
    kv = _hybrid(64)
    req = _run_prompt(kv, "a", list(range(4 * W)))
    for _ in range(3 * BS):
        req.append_output_token_ids([5])
        new = kv.allocate_slots(req, 1)
        assert new is not None and len(new) == 2 and len(new[0]) == len(new[1])
        kv.check_invariants()
        full, local = kv.get_group_block_ids("a")
        assert len(full) == len(local) and NULL_BLOCK_ID not in full
        first = max(0, req.num_computed_tokens - W + 1) // BS
        assert first > 0 and local[:first] == [NULL_BLOCK_ID] * first
        assert NULL_BLOCK_ID not in local[first:] and len(local) - first <= W // BS + 1
        req.num_computed_tokens += 1
        kv.cache_blocks(req, req.num_computed_tokens)
    full, local = kv.get_group_block_ids("a")
    held_local = sum(b != NULL_BLOCK_ID for b in local)
    assert kv.num_held_blocks("a") == len(full) + held_local
    assert kv.pool.num_used_blocks == len(full) + held_local < 2 * len(full)
    kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0 and kv.get_group_block_ids("a") == [[], []]


def test_prompt_cache_hit_across_windows_is_the_longest_valid_in_every_group():
    tokens = list(range(6 * BS + 1))
    kv = _hybrid(64)
    first = _run_prompt(kv, "a", tokens)
    full_a, local_a = [list(t) for t in kv.get_group_block_ids("a")]
    kv.free(first)
    # A hit in both groups: the global group's every block, the window's blocks from the
    # window before the hit point on (earlier ones null).
    (full, local), num = kv.get_computed_blocks(make_request("b", tokens, max_tokens=8))
    assert num == 6 * BS and full == full_a[:6]
    needed = (num - W + 1) // BS
    assert local == [NULL_BLOCK_ID] * needed + local_a[needed:6]
    # Evict the window group's block 0: not in any hit's window, the hit stays whole.
    kv.pool._cached_free.pop(local_a[0])
    kv.pool._evict(local_a[0])
    kv.pool._free.append(local_a[0])
    assert kv.get_computed_blocks(make_request("c", tokens, max_tokens=8))[1] == 6 * BS
    # Evict the window group's block 4: hits of 5 or 6 blocks see it; 4 blocks do not.
    kv.pool._cached_free.pop(local_a[4])
    kv.pool._evict(local_a[4])
    kv.pool._free.append(local_a[4])
    hit_d = kv.get_computed_blocks(make_request("d", tokens, max_tokens=8))
    (full, local), num = hit_d
    assert num == 4 * BS and full == full_a[:4]
    assert local == [NULL_BLOCK_ID] * ((num - W + 1) // BS) + local_a[(num - W + 1) // BS:4]
    # A hit is usable: allocate on it; everything comes back.
    d = make_request("d", tokens, max_tokens=8)
    assert kv.allocate_slots(d, len(tokens) - num, [full, local]) is not None
    kv.check_invariants()
    kv.free(d)
    # Evict the global group's block 1: a hit of one block is all the global group allows,
    # and the window group lost the block 0 that it needs: no hit at all.
    kv.pool._cached_free.pop(full_a[1])
    kv.pool._evict(full_a[1])
    kv.pool._free.append(full_a[1])
    (full, local), num = kv.get_computed_blocks(make_request("e", tokens, max_tokens=8))
    assert (full, local, num) == ([], [], 0)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0


def test_blocks_short_counts_what_the_window_frees():
    """A running request past the window: ``num_blocks_short`` counts the window blocks its
    allocation frees first, and agrees with ``allocate_slots``."""
    kv = _hybrid(2 * (4 * W // BS) + 1)  # exactly the prompt's blocks in both groups
    req = _run_prompt(kv, "a", list(range(4 * W)))
    assert kv.get_num_free_blocks() == 0
    req.append_output_token_ids([5])
    # One more token: a new block in each group (2); the window group frees 6 of its 8.
    assert kv.num_blocks_short(req, 1) == 0
    assert kv.allocate_slots(req, 1) is not None
    kv.check_invariants()
    # Preempting it returns every block it holds in both groups.
    assert kv.num_freed_by_preempting("a") == kv.num_held_blocks("a")


def test_scheduler_sizes_the_pool_for_every_group():
    sched_config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)
    cache = CacheConfig(block_size=BS, num_kv_blocks=64)
    # 128 tokens: 32 global blocks + a window of 8 and a step of 32 (11 blocks).
    Scheduler(sched_config, cache, 44, 128, kv_group_windows=[None, W])
    with pytest.raises(ValueError, match="43 blocks over 2 KV cache groups"):
        Scheduler(sched_config, cache, 43, 128, kv_group_windows=[None, W])
