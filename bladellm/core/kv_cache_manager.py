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
- KV cache groups (core/kv_groups.py): a request has one block table per group, all of the
  same length (table ``g`` entry ``i`` holds tokens ``i * block_size ..`` for group ``g``'s
  layers), drawn from one shared pool. Block ids, hits and new blocks are per group
  (``KVBlocks``: one list per group, group 0 first). Most models have one group.
- A window group (its layers attend within ``window`` tokens): a block whose tokens all lie
  before the window of the request's next query is freed as the request moves on, and its
  table entry becomes the null block (vLLM v1's sliding-window manager); the attention
  kernels never read keys before a query's window, so the table keeps its length and
  positions. A global group keeps every block.
- A prompt-cache hit of k blocks must be valid in every group: in a global group the first k
  blocks are cached; in a window group the blocks inside the window before the hit point are
  (earlier ones may have been evicted; they come back null). The hit is the longest k valid in
  all groups. Each group caches its blocks under its own key of the same token hash.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bladellm.core.block_pool import NULL_BLOCK_ID, BlockPool, _require
from bladellm.core.hashing import BlockHash, extend_block_hashes, request_extra_keys
from bladellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


KVBlocks = Sequence[Sequence[int]]  # one list of block ids per group, group 0 first


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None) -> None:
        """``group_windows``: the window (None: global) of each KV cache group; by default
        one group with ``sliding_window``."""
        windows = list(group_windows) if group_windows is not None else [sliding_window]
        if not windows:
            raise ValueError("the KV cache needs at least one group")
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = windows
        self.num_groups = len(windows)
        # The single group's window (the all-window path); None with several groups.
        self.sliding_window = windows[0] if self.num_groups == 1 else None
        self.pool = BlockPool(num_blocks)
        # Per group: request -> block table, and how many leading blocks were freed (now
        # null) for a window.
        self._tables: list[dict[str, list[int]]] = [{} for _ in windows]
        self._num_skipped: list[dict[str, int]] = [{} for _ in windows]
        self.req_to_blocks = self._tables[0]
        # How many leading blocks of each request have been registered in the cache (the
        # same in every group).
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
        """Group 0's table of the request (its only one without hybrid groups)."""
        return self.req_to_blocks.get(req_id, [])

    def get_group_block_ids(self, req_id: str) -> list[list[int]]:
        """Every group's table of the request, group 0 first."""
        return [tables.get(req_id, []) for tables in self._tables]

    def num_held_blocks(self, req_id: str | None = None) -> int:
        """Blocks (not null entries) held in every group's tables: of one request, or all."""
        return sum(1 for tables in self._tables
                   for rid, table in tables.items() if req_id is None or rid == req_id
                   for b in table if b != NULL_BLOCK_ID)

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """The request's full-block hashes, extended lazily as its tokens grow."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size,
                                   request_extra_keys(req.lora_id), req.mm_items)

    @staticmethod
    def _key(group: int, block_hash: BlockHash):
        """Group ``group``'s cache key of a block hash (group 0: the hash itself)."""
        return block_hash if group == 0 else (group, block_hash)

    def _num_reusable_blocks(self, req: Request) -> int:
        # Leave at least one token to compute: a fully cached prompt recomputes its last block.
        return (req.num_tokens - 1) // self.block_size

    def _no_hit(self) -> list[list[int]]:
        return [[] for _ in range(self.num_groups)]

    def get_computed_blocks(self, req: Request) -> tuple[list[list[int]], int]:
        """Longest cached prefix of a request that holds no blocks: (block ids per group, num
        tokens). None for a request that wants prompt logprobs: the runner computes them from
        the request's own prefill, which must then run every prompt position (as vLLM does)."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return self._no_hit(), 0
        hashes = self.block_hashes(req)[:self._num_reusable_blocks(req)]
        if self.num_groups == 1 and self.sliding_window is None:
            blocks = []
            for block_hash in hashes:
                block_id = self.pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                blocks.append(block_id)
            return [blocks], len(blocks) * self.block_size
        return self._group_hit(hashes)

    def _first_needed_block(self, num_tokens: int, window: int) -> int:
        """First block the query at position ``num_tokens`` can see with the window."""
        return max(0, num_tokens - window + 1) // self.block_size

    def _valid_hits(self, found: Sequence[int | None], window: int | None) -> list[bool]:
        """valid[k]: a hit of k blocks is usable in a group whose lookups gave ``found``: all
        of ``found[:k]`` cached (global), or those in the window before block k (a window:
        each hash chains its whole prefix, so the tokens before match too)."""
        valid = [True] * (len(found) + 1)
        run_start = 0  # cached run found[run_start:k]
        for k in range(1, len(found) + 1):
            if found[k - 1] is None:
                run_start = k
            valid[k] = run_start <= (0 if window is None
                                     else self._first_needed_block(k * self.block_size, window))
        return valid

    def _group_hit(self, hashes: Sequence[BlockHash]) -> tuple[list[list[int]], int]:
        """The longest hit valid in every group; blocks a window no longer needs come back
        as the null block."""
        found, valid = [], [True] * (len(hashes) + 1)
        for g, window in enumerate(self.group_windows):
            found.append([self.pool.get_cached_block(self._key(g, h)) for h in hashes])
            valid = [a and b for a, b in zip(valid, self._valid_hits(found[g], window))]
        best = max(k for k, ok in enumerate(valid) if ok)
        if best == 0:
            return self._no_hit(), 0
        blocks = []
        for g, window in enumerate(self.group_windows):
            first = 0 if window is None else self._first_needed_block(best * self.block_size,
                                                                      window)
            blocks.append([NULL_BLOCK_ID] * first + [b for b in found[g][first:best]
                                                     if b is not None])
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
                       new_computed_blocks: KVBlocks = ()) -> list[list[int]] | None:
        """Grow the request's block tables to hold its computed tokens, the prompt-cache hit
        ``new_computed_blocks`` (per group, from ``get_computed_blocks``; only when it holds
        no blocks yet) and ``num_new_tokens``. Window groups first free the blocks their next
        query no longer sees.

        Returns the block ids appended to each group's table (hits first), or None, changing
        nothing but those window frees, when the pool cannot supply them.
        """
        req_id = req.request_id
        tables = [tables.get(req_id, []) for tables in self._tables]
        for g, window in enumerate(self.group_windows):
            if window is not None and tables[g]:
                self._free_outside_window(g, req_id, tables[g], req.num_computed_tokens, window)
        blocks = tables[0]
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        if (not num_hit and blocks
                and req.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size):
            return self._no_hit()  # the common decode step: the last block still has room
        _require(not num_hit or not blocks, "prompt-cache hit for a running request")
        num_fresh = self._num_fresh(req, num_new_tokens, num_hit)
        if self._num_short(num_fresh * self.num_groups, new_computed_blocks):
            return None
        hits_per_group = [list(new_computed_blocks[g]) if num_hit else []
                          for g in range(self.num_groups)]
        # Every group's hits first: allocating may evict cached-free blocks.
        self.pool.touch(b for hits in hits_per_group for b in hits
                        if b != NULL_BLOCK_ID)  # window: none before it
        new_blocks = []
        for g, (window, hits) in enumerate(zip(self.group_windows, hits_per_group)):
            fresh = self.pool.allocate(num_fresh)
            if req_id not in self._tables[g]:
                self._tables[g][req_id] = tables[g]
            tables[g].extend(hits)
            tables[g].extend(fresh)
            if window is not None and num_hit:
                self._num_skipped[g][req_id] = hits.count(NULL_BLOCK_ID)
            new_blocks.append(hits + fresh)
        self._num_cached_blocks.setdefault(req_id, num_hit)
        if self.enable_caching and num_fresh:
            self._mark_pending(req, len(blocks) - num_fresh, len(blocks))
        return new_blocks

    def num_blocks_short(self, req: Request, num_new_tokens: int,
                         new_computed_blocks: KVBlocks = ()) -> int:
        """How many more free blocks ``allocate_slots`` with these arguments needs (0: it would
        succeed now), counting the blocks its window frees would return; the priority
        scheduler sizes its preemptions with it."""
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_fresh = self._num_fresh(req, num_new_tokens, num_hit) * self.num_groups
        return max(self._num_short(num_fresh, new_computed_blocks)
                   - self._num_freed_by_window(req), 0)

    def num_freed_by_preempting(self, req_id: str, new_computed_blocks: KVBlocks = ()) -> int:
        """Blocks that freeing request ``req_id`` returns to the free count, leaving out those
        another holds and those in ``new_computed_blocks`` (a hit about to take them back)."""
        hits = {b for group in new_computed_blocks for b in group}
        return sum(1 for tables in self._tables for b in tables.get(req_id, ())
                   if b != NULL_BLOCK_ID and self.pool.ref_cnt[b] == 1 and b not in hits)

    def _num_freed_by_window(self, req: Request) -> int:
        """Blocks ``allocate_slots`` would free for the request's windows before allocating."""
        num = 0
        for g, window in enumerate(self.group_windows):
            table = self._tables[g].get(req.request_id)
            if window is None or not table:
                continue
            end = min(self._first_needed_block(req.num_computed_tokens, window), len(table))
            num += sum(1 for b in table[self._num_skipped[g].get(req.request_id, 0):end]
                       if b != NULL_BLOCK_ID and self.pool.ref_cnt[b] == 1)
        return num

    def _num_fresh(self, req: Request, num_new_tokens: int, num_hit: int) -> int:
        """New blocks per group (every group's table has the same length)."""
        num_held = len(self.req_to_blocks.get(req.request_id, ()))
        num_tokens = req.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        return max(cdiv(num_tokens, self.block_size) - num_held - num_hit, 0)

    def _num_short(self, num_fresh: int, new_computed_blocks: KVBlocks) -> int:
        # Hits sitting in the cached-free list stop being evictable once touched.
        num_evictable_hits = sum(1 for group in new_computed_blocks for b in group
                                 if b != NULL_BLOCK_ID and self.pool.ref_cnt[b] == 0)
        return max(num_fresh - (self.pool.get_num_free_blocks() - num_evictable_hits), 0)

    def _free_outside_window(self, group: int, req_id: str, blocks: list[int],
                             num_computed: int, window: int) -> None:
        """Free the request's blocks of a window group wholly before its next query's window
        (null in its table); leading first, so the oldest are evicted first."""
        skipped = self._num_skipped[group]
        start = skipped.get(req_id, 0)
        end = min(self._first_needed_block(num_computed, window), len(blocks))
        if end <= start:
            return
        self.pool.free(b for b in blocks[start:end] if b != NULL_BLOCK_ID)
        blocks[start:end] = [NULL_BLOCK_ID] * (end - start)
        skipped[req_id] = end

    def _mark_pending(self, req: Request, start: int, end: int) -> None:
        hashes = self.block_hashes(req)
        mine = self._req_pending.setdefault(req.request_id, [])
        for block_hash in hashes[start:min(end, len(hashes))]:
            if block_hash not in self._pending and self.pool.get_cached_block(block_hash) is None:
                self._pending[block_hash] = req.request_id
                mine.append(block_hash)

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks made full by its computed tokens (after a step), in
        every group."""
        if not self.enable_caching:
            return
        req_id = req.request_id
        start = self._num_cached_blocks.get(req_id, 0)
        num_full = num_computed_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self.block_hashes(req)
        for g, tables in enumerate(self._tables):
            blocks = tables[req_id]
            for i in range(start, num_full):
                self.pool.cache_block(blocks[i], self._key(g, hashes[i]))
        for i in range(start, num_full):
            if self._pending.get(hashes[i]) == req_id:
                del self._pending[hashes[i]]
        self._num_cached_blocks[req_id] = num_full

    def free(self, req: Request) -> None:
        """Release all of a request's blocks in every group, tail first so its tail is evicted
        first."""
        req_id = req.request_id
        if req_id not in self.req_to_blocks:
            return
        for tables, skipped in zip(self._tables, self._num_skipped):
            blocks = tables.pop(req_id)
            self.pool.free(b for b in reversed(blocks) if b != NULL_BLOCK_ID)
            skipped.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        for block_hash in self._req_pending.pop(req_id, ()):
            if self._pending.get(block_hash) == req_id:
                del self._pending[block_hash]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # --- debugging -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """No block lost or double-freed; ref counts equal the number of requests holding them;
        every group holds the same requests with tables of one length."""
        holders: Counter[int] = Counter()
        for g, (tables, window) in enumerate(zip(self._tables, self.group_windows)):
            _require(tables.keys() == self.req_to_blocks.keys(),
                     f"group {g} holds other requests than group 0")
            for req_id, table in tables.items():
                _require(len(table) == len(self.req_to_blocks[req_id]),
                         f"{req_id}: group {g}'s table has another length than group 0's")
                # Null entries: blocks freed for a window, always a leading run.
                skipped = self._num_skipped[g].get(req_id, 0)
                _require(window is not None or skipped == 0,
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
