import pytest

from bladellm.core.block_pool import NULL_BLOCK_ID, BlockAccountingError, BlockPool


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK_ID not in blocks
    assert pool.get_num_free_blocks() == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.check_invariants({b: 1 for b in blocks})


def test_too_small_pool_names_the_flag():
    with pytest.raises(ValueError, match="--num_kv_blocks"):
        BlockPool(1)


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 123)
    pool.touch([b])  # a second request shares it
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and pool.get_num_free_blocks() == 2
    pool.free([b])
    assert pool.get_num_cached_free_blocks() == 1 and pool.get_num_free_blocks() == 3
    with pytest.raises(BlockAccountingError, match="twice"):
        pool.free([b])


def test_cached_free_blocks_are_reused_by_hash_and_leave_the_lru_when_touched():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 11)
    pool.free([a, b])  # b had no hash: plain free
    assert pool.get_cached_block(11) == a
    assert pool.get_num_cached_free_blocks() == 1
    pool.touch([a])
    assert pool.ref_cnt[a] == 1 and pool.get_num_cached_free_blocks() == 0
    # The touched block can no longer be evicted: allocating everything else leaves it alone.
    others = pool.allocate(pool.get_num_free_blocks())
    assert a not in others and pool.get_cached_block(11) == a
    pool.check_invariants({a: 1, **{o: 1 for o in others}})


def test_allocation_prefers_never_cached_blocks_then_evicts_lru():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    pool.free(reversed(blocks))  # tail first: blocks[2] is the least recently freed
    assert pool.get_num_free_blocks() == 5
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(blocks), "evicted a cached block while free ones remained"
    assert all(pool.get_cached_block(100 + i) == b for i, b in enumerate(blocks))
    (evicted,) = pool.allocate(1)
    assert evicted == blocks[2]
    assert pool.get_cached_block(102) is None and pool.get_cached_block(100) == blocks[0]
    assert pool.block_hash[evicted] is None and pool.num_evictions == 1
    (evicted,) = pool.allocate(1)
    assert evicted == blocks[1]
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 5)
    assert not pool.cache_block(b, 5)
    assert pool.get_cached_block(5) == a
    pool.free([b, a])
    assert pool.get_num_cached_free_blocks() == 1  # b went back to the plain free list
    pool.check_invariants()


def test_reset_prefix_cache_forgets_only_free_cached_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) == b
    pool.check_invariants({b: 1})


def test_check_invariants_catches_corruption():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockAccountingError, match="held by 0"):
        pool.check_invariants({})
    pool.ref_cnt[a] = 0  # lost: neither held nor in a free list
    with pytest.raises(BlockAccountingError, match="lost"):
        pool.check_invariants()
