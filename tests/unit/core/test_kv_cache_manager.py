import pytest

from bladellm.core.block_pool import NULL_BLOCK_ID, BlockAccountingError
from bladellm.core.hashing import extend_block_hashes, hash_block_tokens
from bladellm.core.kv_cache_manager import KVCacheManager
from sched_utils import make_request

BS = 4


def compute(kv: KVCacheManager, req, num_tokens: int, hits=()):
    """Allocate, 'run' ``num_tokens`` more tokens, and register what became full."""
    new = kv.allocate_slots(req, num_tokens, hits)
    assert new is not None
    req.num_computed_tokens += num_tokens + (len(hits[0]) * BS if hits else 0)
    kv.cache_blocks(req, req.num_computed_tokens)
    return new[0] if kv.num_groups == 1 else new


def test_hashes_chain_parent_tokens_and_salt():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    hashes = extend_block_hashes([], list(range(10)), BS)
    assert len(hashes) == 2  # only full blocks
    assert extend_block_hashes(hashes, list(range(12)), BS)[:2] == hashes[:2]


def test_shared_prefix_hits_only_full_blocks():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(100, 110)))  # 10 tokens: 2 full blocks + 2
    blocks_a = compute(kv, a, 10)
    assert len(blocks_a) == 3
    b = make_request("b", list(range(100, 108)) + [1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == [blocks_a[:2]] and num_hit == 8
    compute(kv, b, b.num_tokens - num_hit, hits)
    assert kv.pool.ref_cnt[blocks_a[0]] == 2 and kv.pool.ref_cnt[blocks_a[2]] == 1
    kv.check_invariants()


def test_fully_cached_prompt_still_recomputes_its_last_token():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(8)))  # exactly 2 full blocks
    compute(kv, a, 8)
    b = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and len(hits[0]) == 1  # the last full block is recomputed, not shared
    c = make_request("c", list(range(9)))
    assert kv.get_computed_blocks(c)[1] == 8


def test_blocks_are_registered_only_once_computed():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # allocated, not computed yet
    assert kv.get_computed_blocks(make_request("b", list(range(12))))[1] == 0
    a.num_computed_tokens = 6
    kv.cache_blocks(a, 6)
    assert kv.get_computed_blocks(make_request("c", list(range(12))))[1] == 4


def test_disabled_cache_never_hits():
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([[]], 0)
    kv.free(a)
    assert kv.pool.get_num_cached_free_blocks() == 0


def test_free_releases_tail_first_so_tails_are_evicted_first():
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_request("a", list(range(13)))  # 3 full blocks + 1
    blocks = compute(kv, a, 13)
    kv.free(a)
    assert kv.pool.get_num_free_blocks() == 4
    b = make_request("b", list(range(50, 58)))  # needs 2 blocks: the free one + 1 eviction
    compute(kv, b, 8)
    # The evicted block is a's tail (block 3); a's first two blocks are still a prefix hit.
    assert kv.get_computed_blocks(make_request("c", list(range(13))))[0] == [blocks[:2]]
    kv.check_invariants()


def test_allocate_fails_cleanly_counting_evictable_hits():
    kv = KVCacheManager(4, BS)  # 3 usable
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)  # 3 blocks, 2 of them cached
    kv.free(a)
    b = make_request("b", list(range(8)) + [99] * 8)  # hit 2 blocks, needs 2 more: 4 > 3
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits[0]) == 2
    assert kv.allocate_slots(b, 8, hits) is None
    assert kv.pool.get_num_free_blocks() == 3 and "b" not in kv.req_to_blocks
    kv.check_invariants()
    assert kv.allocate_slots(b, 4, hits) is not None  # one chunk of 4 fits


def test_pending_blocks_are_tracked_until_computed_or_freed():
    kv = KVCacheManager(16, BS)
    owner = make_request("owner", list(range(13)))
    sibling = make_request("sib", list(range(13)))
    kv.allocate_slots(owner, 13)
    assert kv.pending_owner(sibling, 0) == "owner"
    assert kv.pending_owner(owner, 0) is None  # never waits on itself
    owner.num_computed_tokens = 8
    kv.cache_blocks(owner, 8)
    hits, _ = kv.get_computed_blocks(sibling)
    assert len(hits[0]) == 2 and kv.pending_owner(sibling, 2) == "owner"
    kv.free(owner)
    assert kv.pending_owner(sibling, 2) is None
    kv.check_invariants()


def test_check_invariants_catches_a_lost_reference():
    kv = KVCacheManager(8, BS)
    a = make_request("a", 5)
    kv.allocate_slots(a, 5)
    kv.req_to_blocks["a"].pop()
    with pytest.raises(BlockAccountingError):
        kv.check_invariants()


# --- sliding window ------------------------------------------------------------------------------


def _windowed(num_blocks: int, window: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, sliding_window=window)


def _req(req_id: str, tokens: list[int]):
    return make_request(req_id, tokens, max_tokens=64)


def test_window_frees_blocks_before_the_next_query_window():
    """A request of 4x the window holds about window / block_size blocks, the rest null."""
    window = 2 * BS
    kv = _windowed(16, window)
    req = _req("a", list(range(8 * BS)))
    assert kv.allocate_slots(req, 8 * BS) is not None  # the whole prompt in one step
    req.num_computed_tokens = 8 * BS
    kv.cache_blocks(req, req.num_computed_tokens)
    for _ in range(3 * BS):  # decode: each step frees what fell out of the window
        req.append_output_token_ids([5])
        assert kv.allocate_slots(req, 1) is not None
        kv.check_invariants()
        table = kv.get_block_ids("a")
        held = [b for b in table if b != NULL_BLOCK_ID]
        # this step's query (position num_computed) sees num_computed - window + 1 on
        assert len(held) <= window // BS + 1
        first = max(0, req.num_computed_tokens - window + 1) // BS
        assert first > 0 and all(b == NULL_BLOCK_ID for b in table[:first])
        assert NULL_BLOCK_ID not in table[first:]
        req.num_computed_tokens += 1
        kv.cache_blocks(req, req.num_computed_tokens)
    kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0


def test_window_prompt_cache_hit_needs_only_the_window_blocks():
    """Blocks before the window may be evicted: the hit still covers the prefix, with null
    entries before the window; a full-attention manager stops at the first missing block."""
    window = 2 * BS
    tokens = list(range(6 * BS + 1))
    for sliding_window, want_tokens in ((window, 6 * BS), (None, 0)):
        kv = KVCacheManager(32, BS, sliding_window=sliding_window)
        first = _req("a", tokens)
        assert kv.allocate_slots(first, len(tokens)) is not None
        first.num_computed_tokens = len(tokens)
        kv.cache_blocks(first, first.num_computed_tokens)
        first_blocks = list(kv.get_block_ids("a"))
        kv.free(first)
        # Evict the first block only (as if the LRU had taken it).
        kv.pool._cached_free.pop(first_blocks[0])
        kv.pool._evict(first_blocks[0])
        kv.pool._free.append(first_blocks[0])
        second = _req("b", tokens)
        blocks, num = kv.get_computed_blocks(second)
        assert num == want_tokens
        if sliding_window is not None:
            [blocks] = blocks
            needed = (num - window + 1) // BS
            assert blocks[:needed] == [NULL_BLOCK_ID] * needed
            assert blocks[needed:] == first_blocks[needed:6]
            assert kv.allocate_slots(second, len(tokens) - num, [blocks]) is not None
            second.num_computed_tokens = num
            kv.check_invariants()
            kv.free(second)
        kv.check_invariants()
        assert kv.pool.num_used_blocks == 0
