"""Per-request KV block tables on top of the ``BlockPool``; the prompt (prefix) cache.

The manager hands out block ids only; the runner owns the tensors. Rules:

- A request's block table covers its computed tokens plus the tokens scheduled this step.
- Only FULL blocks are shared. A block is registered in the cache after the step that computed
  its last token (``cache_blocks``), never when it is allocated.
- A prompt-cache lookup always leaves at least one token to compute, so there are logits to
  sample; a request with a hit therefore never writes into a shared block.
- "Pending" hashes: full blocks allocated by a running request but not computed yet. The
  scheduler holds back a request whose next block is pending elsewhere (``n > 1`` siblings, or
  many users with one system prompt) so that it gets a hit instead of recomputing it. Freeing
  the owner drops its pending entries, so nobody waits on a request that will not compute them.
- Sliding window (``sliding_window``: every attention layer of the model has a window, this
  is the widest): a block whose tokens all lie before the window of the request's next query
  is freed as the request moves on, and its table entry becomes the null block (vLLM v1's
  sliding-window manager); the attention kernels never read keys before a query's window, so
  the table keeps its length and positions. A prompt-cache hit then needs only the blocks
  inside the window before the hit point; earlier ones may have been evicted (null too).
  Without a window nothing of this runs: the full-attention path is the same code as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bladellm.core.block_pool import NULL_BLOCK_ID, BlockPool, _require
from bladellm.core.hashing import BlockHash, extend_block_hashes, request_extra_keys
from bladellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Window: per request, how many leading blocks were freed (now null) for it.
        self._num_skipped_blocks: dict[str, int] = {}
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        # How many leading blocks of each request have been registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._pending: dict[BlockHash, str] = {}  # block hash -> request computing it
        self._req_pending: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative

    # --- queries -------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        return self.req_to_blocks.get(req_id, [])

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """The request's full-block hashes, extended lazily as its tokens grow."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                                   request_extra_keys(req.lora_id), req.mm_items)

    def _num_reusable_blocks(self, req: Request) -> int:
        # Leave at least one token to compute: a fully cached prompt recomputes its last block.
        return (req.num_tokens - 1) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids, num tokens).
        None for a request that wants prompt logprobs: the runner computes them from the
        request's own prefill, which must then run every prompt position (as vLLM does)."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self.block_hashes(req)
        if self.sliding_window is not None:
            return self._windowed_hit(hashes[:self._num_reusable_blocks(req)])
        blocks = []
        for block_hash in hashes[:self._num_reusable_blocks(req)]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def _first_needed_block(self, num_tokens: int) -> int:
        """First block the query at position ``num_tokens`` can see with the window."""
        assert self.sliding_window is not None
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def _windowed_hit(self, hashes: Sequence[BlockHash]) -> tuple[list[int], int]:
        """The longest hit of k blocks whose window blocks ``[first_needed(k * bs), k)`` are all
        cached (each hash chains its whole prefix, so the tokens before match too); blocks
        before the window come back as the null block."""
        found = [self.pool.get_cached_block(h) for h in hashes]
        best, run_start = 0, 0  # cached run found[run_start:k]
        for k in range(1, len(found) + 1):
            if found[k - 1] is None:
                run_start = k
            elif run_start <= self._first_needed_block(k * self.block_size):
                best = k
        if best == 0:
            return [], 0
        first = self._first_needed_block(best * self.block_size)
        blocks = [NULL_BLOCK_ID] * first + [b for b in found[first:best] if b is not None]
        return blocks, best * self.block_size

    def pending_owner(self, req: Request, num_computed_blocks: int) -> str | None:
        """The running request computing the next block ``req`` would compute itself, if any."""
        if not self.enable_caching or num_computed_blocks >= self._num_reusable_blocks(req):
            return None
        owner = self._pending.get(self.block_hashes(req)[num_computed_blocks])
        return owner if owner != req.request_id else None

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    # --- mutations -----------------------------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's block table to hold its computed tokens, the prompt-cache hit
        ``new_computed_blocks`` (only when it holds no blocks yet) and ``num_new_tokens``.

        Returns the block ids appended to its table (hits first), or None, changing nothing,
        when the pool cannot supply them.
        """
        req_id = req.request_id
        blocks = self.req_to_blocks.get(req_id, [])
        if self.sliding_window is not None and blocks:
            self._free_outside_window(req_id, blocks, req.num_computed_tokens)
        if (not new_computed_blocks and blocks
                and req.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size):
            return []  # the common decode step: the last block still has room
        _require(not new_computed_blocks or not blocks, "prompt-cache hit for a running request")
        num_fresh = self._num_fresh(req, num_new_tokens, new_computed_blocks)
        if self._num_short(num_fresh, new_computed_blocks):
            return None
        hits = [b for b in new_computed_blocks if b != NULL_BLOCK_ID]  # window: none before it
        self.pool.touch(hits)
        fresh = self.pool.allocate(num_fresh)
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = blocks
            self._num_cached_blocks[req_id] = len(new_computed_blocks)
        start = len(blocks) + len(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh)
        if self.enable_caching and fresh:
            self._mark_pending(req, start, len(blocks))
        if self.sliding_window is not None and new_computed_blocks:
            self._num_skipped_blocks[req_id] = len(new_computed_blocks) - len(hits)
        return list(new_computed_blocks) + fresh

    def num_blocks_short(self, req: Request, num_new_tokens: int,
                         new_computed_blocks: Sequence[int] = ()) -> int:
        """How many more free blocks ``allocate_slots`` with these arguments needs (0: it would
        succeed now); the priority scheduler sizes its preemptions with it."""
        return self._num_short(self._num_fresh(req, num_new_tokens, new_computed_blocks),
                               new_computed_blocks)

    def _num_fresh(self, req: Request, num_new_tokens: int,
                   new_computed_blocks: Sequence[int]) -> int:
        num_held = len(self.req_to_blocks.get(req.request_id, ()))
        num_tokens = (req.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        return max(cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks), 0)

    def _num_short(self, num_fresh: int, new_computed_blocks: Sequence[int]) -> int:
        # Hits sitting in the cached-free list stop being evictable once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks
                                 if b != NULL_BLOCK_ID and self.pool.ref_cnt[b] == 0)
        return max(num_fresh - (self.pool.get_num_free_blocks() - num_evictable_hits), 0)

    def _free_outside_window(self, req_id: str, blocks: list[int], num_computed: int) -> None:
        """Free the request's blocks wholly before its next query's window (null in its
        table); leading first, so the oldest are evicted first."""
        start = self._num_skipped_blocks.get(req_id, 0)
        end = min(self._first_needed_block(num_computed), len(blocks))
        if end <= start:
            return
        self.pool.free(b for b in blocks[start:end] if b != NULL_BLOCK_ID)
        blocks[start:end] = [NULL_BLOCK_ID] * (end - start)
        self._num_skipped_blocks[req_id] = end

    def _mark_pending(self, req: Request, start: int, end: int) -> None:
        hashes = self.block_hashes(req)
        mine = self._req_pending.setdefault(req.request_id, [])
        for block_hash in hashes[start:min(end, len(hashes))]:
            if block_hash not in self._pending and self.pool.get_cached_block(block_hash) is None:
                self._pending[block_hash] = req.request_id
                mine.append(block_hash)

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks made full by its computed tokens (after a step)."""
        if not self.enable_caching:
            return
        req_id = req.request_id
        start = self._num_cached_blocks.get(req_id, 0)
        num_full = num_computed_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self.block_hashes(req)
        blocks = self.req_to_blocks[req_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
            if self._pending.get(hashes[i]) == req_id:
                del self._pending[hashes[i]]
        self._num_cached_blocks[req_id] = num_full

    def free(self, req: Request) -> None:
        """Release all of a request's blocks, tail first so its tail is evicted first."""
        req_id = req.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        if blocks is None:
            return
        self.pool.free(b for b in reversed(blocks) if b != NULL_BLOCK_ID)
        self._num_cached_blocks.pop(req_id, None)
        self._num_skipped_blocks.pop(req_id, None)
        for block_hash in self._req_pending.pop(req_id, ()):
            if self._pending.get(block_hash) == req_id:
                del self._pending[block_hash]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # --- debugging -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """No block lost or double-freed; ref counts equal the number of requests holding them."""
        holders: Counter[int] = Counter()
        for req_id, table in self.req_to_blocks.items():
            # Null entries: blocks freed for a window, always a leading run.
            skipped = self._num_skipped_blocks.get(req_id, 0)
            _require(self.sliding_window is not None or skipped == 0,
                     f"{req_id}: blocks skipped without a window")
            _require(all(b == NULL_BLOCK_ID for b in table[:skipped]),
                     f"{req_id}: a skipped block is still in its table")
            blocks = table[skipped:]
            _require(len(set(blocks)) == len(blocks), f"{req_id} holds a block twice")
            _require(NULL_BLOCK_ID not in blocks, f"{req_id} holds the null block")
            _require(self._num_cached_blocks.get(req_id, 0) <= len(table),
                     f"{req_id}: more blocks cached than held")
            holders.update(blocks)
        self.pool.check_invariants(dict(holders))
        for block_hash, owner in self._pending.items():
            _require(owner in self.req_to_blocks, f"pending block of {owner}, which holds none")
