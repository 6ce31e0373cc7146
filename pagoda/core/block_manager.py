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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pagoda.core import block_hash as hashing

if TYPE_CHECKING:
    from pagoda.core.request import Request


class AuditError(AssertionError):
    """The ledger is inconsistent; the message says what failed."""


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
        self._key_of: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (parent hash, tokens)
        self._num_offered: dict[str, int] = {}  # request -> leading table blocks already offered to the cache
        # hash -> the (parent hash, tokens) key object the audit last hashed to it: an unchanged key
        # (the same immutable tuple) need not be hashed again on every audit
        self._audited_keys: dict[int, tuple[int, tuple[int, ...]]] = {}

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

    # -- the one place the invariants are checked ----------------------
    def audit(self, computed_tokens: Mapping[str, int], token_ids: Mapping[str, Sequence[int]] | None = None) -> None:
        """Check every ledger and cache invariant; raises AuditError naming the first that fails.

        `computed_tokens` maps each live request to its computed tokens; `token_ids`, when given,
        maps live requests to their tokens, against which the cached blocks they hold are checked.
        """
        self._audit_pool()
        self._audit_cache()
        for request_id in self._tables.keys() - computed_tokens.keys():
            raise AuditError(f"blocks held by {request_id!r}, which is not a live request")
        for request_id, num_computed in computed_tokens.items():
            table = self._tables.get(request_id, [])
            want = self.blocks_for(num_computed)
            if len(table) != want:
                raise AuditError(
                    f"request {request_id!r} has {num_computed} computed tokens but {len(table)} blocks (want {want})"
                )
            tokens = token_ids.get(request_id) if token_ids is not None else None
            self._audit_held_cached_blocks(request_id, table, num_computed, tokens)

    def _audit_pool(self) -> None:
        if self._pool_consistent():
            return
        self._explain_pool()

    def _pool_consistent(self) -> bool:
        """The pool checks of `_explain_pool` as whole-list comparisons (it runs every step); True when all hold."""
        refs, hash_of = self._ref_counts, self._hash_of
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            if len(set(table)) != len(table):
                return False
            for block_id in table:
                holders[block_id] += 1
        if holders != refs:
            return False
        free_set, cached_free_set = set(self._free), set(self._cached_free)
        unowned = {block_id for block_id, n in enumerate(refs) if n == 0}
        return (
            len(free_set) == len(self._free)
            and not free_set & cached_free_set
            and free_set | cached_free_set == unowned
            and all(hash_of[block_id] is None for block_id in free_set)
            and all(hash_of[block_id] is not None for block_id in cached_free_set)
            and all(hash_of[block_id] is not None for block_id, n in enumerate(refs) if n > 1)
        )

    def _explain_pool(self) -> None:
        """The pool checks block by block, raising AuditError naming the first that fails."""
        free, cached_free = list(self._free), list(self._cached_free)
        free_set, cached_free_set = set(free), set(cached_free)
        if len(free_set) != len(free):
            raise AuditError("a block is on the free list twice")
        if free_set & cached_free_set:
            raise AuditError(f"blocks {sorted(free_set & cached_free_set)} are both truly free and cached-free")
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AuditError(f"request {request_id!r} holds a block twice: {table}")
            for block_id in table:
                holders[block_id] += 1
        for block_id in range(self.num_blocks):
            refs, hashed = self._ref_counts[block_id], self._hash_of[block_id] is not None
            if refs != holders[block_id]:
                raise AuditError(f"block {block_id} has ref count {refs} but {holders[block_id]} holders")
            if refs > 1 and not hashed:
                raise AuditError(f"block {block_id} is shared by {refs} requests but holds no cached prefix")
            is_free = block_id in free_set or block_id in cached_free_set
            if is_free == (refs > 0):
                state = "free and owned" if refs else "neither free nor owned"
                raise AuditError(f"block {block_id} is {state}")
            if block_id in cached_free_set and not hashed:
                raise AuditError(f"cached-free block {block_id} has no hash")
            if block_id in free_set and hashed:
                raise AuditError(f"truly free block {block_id} still carries a hash")
        num_used = sum(1 for refs in self._ref_counts if refs)
        if len(free) + len(cached_free) + num_used != self.num_blocks:
            raise AuditError(
                f"free {len(free)} + cached-free {len(cached_free)} + used {num_used} != total {self.num_blocks}"
            )

    def _audit_cache(self) -> None:
        if not self.enable_prefix_caching and self._cached:
            raise AuditError("blocks are cached with prefix caching off")
        carried = {h: block_id for block_id, h in enumerate(self._hash_of) if h is not None}
        if len(carried) != len(self._hash_of) - self._hash_of.count(None) or carried != self._cached:
            self._explain_carriers()
        self._audit_cached_keys()

    def _explain_carriers(self) -> None:
        """Hash carriers against the cache map, raising AuditError naming the first mismatch."""
        carriers: dict[int, list[int]] = {}
        for block_id, h in enumerate(self._hash_of):
            if h is not None:
                carriers.setdefault(h, []).append(block_id)
        for h, blocks in carriers.items():
            if len(blocks) > 1:
                raise AuditError(f"hash {h:#x} maps to blocks {blocks}")
            if self._cached.get(h) != blocks[0]:
                raise AuditError(f"block {blocks[0]} carries hash {h:#x}, which the cache does not map to it")
        if len(self._cached) != len(carriers):
            raise AuditError(f"the cache maps {len(self._cached)} hashes but {len(carriers)} blocks carry one")

    def _audit_cached_keys(self) -> None:
        """Every cached block's stored (parent, tokens) hashes to its hash; a key already checked is not rehashed."""
        audited, self._audited_keys = self._audited_keys, {}
        for h, block_id in self._cached.items():
            key = self._key_of[block_id]
            if key is None or audited.get(h) is not key:
                parent, tokens = key
                if len(tokens) != self.block_size or hashing.hash_block(parent, tokens) != h:
                    raise AuditError(f"block {block_id}'s hash does not match the tokens it holds")
            self._audited_keys[h] = key

    def _audit_held_cached_blocks(
        self, request_id: str, table: list[int], num_computed: int, tokens: Sequence[int] | None
    ) -> None:
        bs = self.block_size
        for i, block_id in enumerate(table):
            h = self._hash_of[block_id]
            if h is None:
                continue
            if (i + 1) * bs > num_computed:
                raise AuditError(f"request {request_id!r} is still writing block {block_id}, which is cached")
            parent, stored = self._key_of[block_id]
            if tokens is not None and tuple(tokens[i * bs : (i + 1) * bs]) != stored:
                raise AuditError(f"request {request_id!r} holds cached block {block_id}, whose tokens are not its own")
            if i > 0 and self._hash_of[table[i - 1]] not in (None, parent):
                raise AuditError(f"request {request_id!r}: cached block {block_id} does not chain from the block before")
