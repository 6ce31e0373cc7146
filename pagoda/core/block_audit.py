"""The one place the ledger's and the prefix cache's invariants are checked: `BlockManager.audit()`.

A mixin of `BlockManager` (pagoda/core/block_manager.py): it reads the ledger's own fields and changes
nothing but its memo of the cache keys it has already hashed. The checks run after every engine step in
the tests and the simulator, so each first runs as whole-list comparisons and only goes block by block
(`_explain_*`) to name what failed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from pagoda.core import block_hash as hashing


class AuditError(AssertionError):
    """The ledger is inconsistent; the message says what failed."""


class LedgerAudit:
    """The audit of a BlockManager; the fields below are the ledger's, set by its __init__."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    _free: deque[int]
    _cached_free: OrderedDict[int, None]
    _ref_counts: list[int]
    _tables: dict[str, list[int]]
    _cached: dict[int, int]
    _hash_of: list[int | None]
    _key_of: list[tuple[int, tuple[int, ...]] | None]
    _audited_keys: dict[int, tuple[int, tuple[int, ...]]]

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
                if key is None or len(key[1]) != self.block_size or hashing.hash_block(*key) != h:
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
