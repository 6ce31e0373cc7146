"""The paged KV-cache ledger: which request owns which block, and which blocks hold a cached prefix.

The pool is `num_blocks` blocks of `block_size` token slots. A request's block
table lists its blocks in position order; slot `p` of a request lives in block
`table[p // block_size]` at offset `p % block_size`. A block is free exactly
when its reference count is zero.

Prefix caching. A full block whose KV has been computed is registered under
its chained hash (`core/block_hash.py`), with the parent hash and tokens it
was registered with, which every hit is verified against. A later request
whose leading blocks hash the same takes those blocks instead of computing
them: the block's count grows by one per table that holds it. When the last
holder lets go, a registered block keeps its hash and waits, free, in an LRU
list of cached-free blocks; a hit takes it back, and it is evicted (its hash
dropped) only when a fresh block is needed and no truly free block is left.
Blocks are registered only once computed, so a block being written is never
shared; a block whose hash is already registered (a duplicate) stays private.

This module is bookkeeping only: it never sees a tensor.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from pagoda.core import block_hash as hashing
from pagoda.core.block_audit import BlockKey, LedgerAudit

if TYPE_CHECKING:
    from pagoda.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # truly free: no hash, taken first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free with a hash, least recently freed first
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[int, int] = {}  # hash -> the one block registered under it
        self._hash_of: list[int | None] = [None] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks  # (parent hash, tokens)
        self._num_offered: dict[str, int] = {}  # request -> leading table blocks already offered to the cache
        self._audit = LedgerAudit(self)  # pagoda/core/block_audit.py: the one place the invariants are checked

    # -- the audit, and what it reads (views, not copies: never changed through them) ----------
    def audit(self, computed_tokens: Mapping[str, int], token_ids: Mapping[str, Sequence[int]] | None = None) -> None:
        """Check every ledger and cache invariant; raises AuditError naming the first that fails.

        `computed_tokens` maps each live request to its computed tokens; `token_ids`, when given,
        maps live requests to their tokens, against which the cached blocks they hold are checked.
        """
        self._audit.check(computed_tokens, token_ids)

    @property
    def free_block_ids(self) -> Sequence[int]:
        return self._free

    @property
    def cached_free_block_ids(self) -> Collection[int]:
        return self._cached_free.keys()

    @property
    def ref_counts(self) -> Sequence[int]:
        return self._ref_counts

    @property
    def tables(self) -> Mapping[str, Sequence[int]]:
        return self._tables

    @property
    def cached_blocks(self) -> Mapping[int, int]:
        return self._cached

    @property
    def block_hashes(self) -> Sequence[int | None]:
        return self._hash_of

    @property
    def block_keys(self) -> Sequence[BlockKey | None]:
        return self._key_of

    # -- counters --------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: truly free plus cached-free."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    # -- the cache -------------------------------------------------------
    def cached_prefix(self, request: Request) -> list[int]:
        """The registered blocks that hold the request's leading tokens, verified; [] with caching off.

        Never the block of the request's last token: that token is computed again so that there
        are logits to sample from (a whole-prompt hit backs off to recompute its last block).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = hashing.block_hashes(request, bs, (request.num_tokens - 1) // bs)
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self._key_of[block_id] != self._key(request, i):  # a hash collision: never share
                break
            hits.append(block_id)
        return hits

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (`num_computed_tokens`)."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        num_full = request.num_computed_tokens // bs
        start = self._num_offered.get(rid, 0)
        if num_full <= start:
            return
        table = self._tables[rid]
        hashes = hashing.block_hashes(request, bs, num_full)
        for i in range(start, num_full):
            block_id, h = table[i], hashes[i]
            if self._hash_of[block_id] is None and h not in self._cached:
                self._cached[h] = block_id
                self._hash_of[block_id] = h
                self._key_of[block_id] = self._key(request, i)
        self._num_offered[rid] = num_full

    def _key(self, request: Request, index: int) -> tuple[int, tuple[int, ...]]:
        """What a cached block is verified against: (parent hash, token ids) of block `index`."""
        bs = self.block_size
        return hashing.parent_hash(request, index), tuple(request.token_ids_slice(index * bs, (index + 1) * bs))

    # -- ownership changes ---------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Whether the table can grow to `num_tokens` slots now, starting with the `cached` hit blocks."""
        return self._missing_blocks(request_id, num_tokens, cached) <= self._num_takeable(cached)

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> list[int]:
        """Grow the request's table to cover `num_tokens` slots, first with `cached` hits; returns the table."""
        missing = self._missing_blocks(request_id, num_tokens, cached)
        if missing > self._num_takeable(cached):
            raise RuntimeError(
                f"allocate({request_id!r}, {num_tokens}) needs {missing} blocks, {self.num_free_blocks} free"
            )
        table = self._tables.setdefault(request_id, [])
        if cached:
            assert not table, f"cache hits for {request_id!r}, which already holds blocks"
            for block_id in cached:
                assert self._hash_of[block_id] is not None, f"hit on block {block_id}, which is not cached"
                if self._ref_counts[block_id] == 0:
                    del self._cached_free[block_id]
                self._ref_counts[block_id] += 1
                table.append(block_id)
            self._num_offered[request_id] = len(cached)  # already registered
        for _ in range(missing):  # usually zero or one
            block_id = self._take_fresh()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return table

    def free(self, request_id: str) -> int:
        """Release every block the request holds; returns how many returned to the pool."""
        table = self._tables.pop(request_id, [])
        self._num_offered.pop(request_id, None)
        returned = 0
        # Last block first, so that a prefix's tail is evicted before its head.
        for block_id in reversed(table):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed with no references"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hash_of[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._cached_free[block_id] = None
                returned += 1
        return returned

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to cover `num_tokens` slots: the blocks only rejected drafts used return."""
        table = self._tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        while table and len(table) > keep:
            block_id = table.pop()
            # never registered: a block joins the cache only once its tokens are accepted and computed
            assert self._hash_of[block_id] is None and self._ref_counts[block_id] == 1, f"trimmed block {block_id}"
            self._ref_counts[block_id] = 0
            self._free.appendleft(block_id)  # the next fresh block again: its slots are overwritten first

    def _take_fresh(self) -> int:
        """A block for new KV: a truly free one, else the least recently freed cached one, evicted."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            del self._cached[self._hash_of[block_id]]
            self._hash_of[block_id] = self._key_of[block_id] = None
        assert self._ref_counts[block_id] == 0, f"free block {block_id} has references"
        return block_id

    def _missing_blocks(self, request_id: str, num_tokens: int, cached: Sequence[int]) -> int:
        # Called twice per request per step (check, then act): kept to plain arithmetic.
        table = self._tables.get(request_id)
        have = (len(table) if table else 0) + len(cached)
        return max(0, (num_tokens + self.block_size - 1) // self.block_size - have)

    def _num_takeable(self, cached: Sequence[int]) -> int:
        """Free blocks left for fresh KV once the hits are taken: a hit on a cached-free block uses one up."""
        free = len(self._free) + len(self._cached_free)
        return free - sum(1 for block_id in cached if self._ref_counts[block_id] == 0) if cached else free
