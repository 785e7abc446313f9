"""A fixed pool of KV-cache blocks: ref counts, free lists, and the prompt-cache hash map.

Invariant (checked by ``check_invariants``): block 0 is the null block (the runner pads block
tables with it; it is never handed out), and every other block is in exactly one state:

- free: ref count 0, no hash, in ``_free`` (FIFO);
- cached-free: ref count 0, has a hash, in ``_cached_free`` in LRU order (oldest first) —
  reusable by a prompt-cache hit until allocation evicts it;
- held: ref count > 0 (in neither list); it may also have a hash (shared full blocks).

Allocation takes never-cached free blocks first and only then evicts the least recently freed
cached block, so cached prefixes live as long as the pool allows. All operations are O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from bladellm.core.hashing import BlockHash

NULL_BLOCK_ID = 0


class BlockAccountingError(AssertionError):
    """A block was lost, double-freed, or its ref count disagrees with its holders."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise BlockAccountingError(msg)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"--num_kv_blocks: need at least 2 blocks (one is reserved), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # --- queries -------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-free (evictable)."""
        return len(self._free) + len(self._cached_free)

    def get_num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-free blocks count as free)."""
        return self.num_used_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block.get(block_hash)

    # --- mutations -----------------------------------------------------------------------------

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` blocks (ref count 1), evicting LRU cached-free blocks if needed."""
        if num > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num} blocks, {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference on cached blocks (a prompt-cache hit)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                _require(block_id in self._cached_free, f"block {block_id} touched but not cached")
                del self._cached_free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order: the first freed is the first
        evicted, so callers free a request's blocks tail first."""
        for block_id in block_ids:
            _require(block_id != NULL_BLOCK_ID, "the null block was freed")
            _require(self.ref_cnt[block_id] > 0, f"block {block_id} freed twice")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, full block under ``block_hash``. Returns False (and leaves the block
        unregistered) when another block already holds that hash: the first one stays shared."""
        _require(self.ref_cnt[block_id] > 0, f"block {block_id} cached while not held")
        if self.block_hash[block_id] is not None:
            return self.block_hash[block_id] == block_hash
        if block_hash in self._hash_to_block:
            return False
        self.block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (held blocks keep their hashes). Returns the count."""
        num = len(self._cached_free)
        while self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._evict(block_id)
            self._free.append(block_id)
        return num

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        self.block_hash[block_id] = None
        if self._hash_to_block.get(block_hash) == block_id:
            del self._hash_to_block[block_hash]
        self.num_evictions += 1

    # --- debugging -----------------------------------------------------------------------------

    def check_invariants(self, expected_ref_cnt: dict[int, int] | None = None) -> None:
        """Every block in exactly one state; with ``expected_ref_cnt`` (block -> number of
        holders), ref counts must match it exactly."""
        free = set(self._free)
        cached = set(self._cached_free)
        _require(len(free) == len(self._free), "a block is twice in the free list")
        _require(not (free & cached), "a block is both free and cached-free")
        _require(NULL_BLOCK_ID not in free | cached, "the null block is in a free list")
        _require(self.ref_cnt[NULL_BLOCK_ID] == 0, "the null block was handed out")
        held = {b for b in range(1, self.num_blocks) if self.ref_cnt[b] > 0}
        _require(not (held & (free | cached)), "a held block is in a free list")
        _require(len(free) + len(cached) + len(held) + 1 == self.num_blocks,
                 f"blocks lost: free={len(free)} cached={len(cached)} held={len(held)} "
                 f"total={self.num_blocks}")
        for block_id in free:
            _require(self.block_hash[block_id] is None, f"free block {block_id} has a hash")
        for block_id in cached:
            _require(self.block_hash[block_id] is not None, f"cached block {block_id} has no hash")
        hashed = [b for b in range(1, self.num_blocks) if self.block_hash[b] is not None]
        _require(len(hashed) == len(self._hash_to_block), "hash map and block hashes disagree")
        for block_id in hashed:
            _require(self._hash_to_block.get(self.block_hash[block_id]) == block_id,
                     f"block {block_id} unreachable by its hash")
        if expected_ref_cnt is not None:
            for block_id in range(1, self.num_blocks):
                want = expected_ref_cnt.get(block_id, 0)
                _require(self.ref_cnt[block_id] == want,
                         f"block {block_id}: ref count {self.ref_cnt[block_id]}, "
                         f"held by {want} requests")
