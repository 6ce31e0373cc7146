"""The one place the ledger's and the prefix cache's invariants are checked: `BlockManager.audit()`.

`LedgerAudit` is an object the ledger (pagoda/core/block_manager.py) holds and delegates `audit()` to. It
reads the ledger through the named, read-only accessors of `Ledger` and changes nothing but its own memo of
the cache keys it has already hashed. The checks run after every engine step in the tests and the
simulator, so each first runs as whole-list comparisons and only goes block by block (`_explain_*`) to
name what failed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from pagoda.core import block_hash as hashing

BlockKey = tuple[int, tuple[int, ...]]  # (parent hash, tokens): what a cached block's hash was made from


class AuditError(AssertionError):
    """The ledger is inconsistent; the message says what failed."""


class Ledger(Protocol):
    """What the audit reads of the ledger: its geometry and, read-only, its lists and maps (views, not copies)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool

    @property
    def free_block_ids(self) -> Sequence[int]: ...  # truly free: no hash

    @property
    def cached_free_block_ids(self) -> Collection[int]: ...  # free and holding a registered hash

    @property
    def ref_counts(self) -> Sequence[int]: ...  # by block id: how many tables hold it

    @property
    def tables(self) -> Mapping[str, Sequence[int]]: ...  # request id -> its block table

    @property
    def cached_blocks(self) -> Mapping[int, int]: ...  # hash -> the one block registered under it

    @property
    def block_hashes(self) -> Sequence[int | None]: ...  # by block id: the hash it carries

    @property
    def block_keys(self) -> Sequence[BlockKey | None]: ...  # by block id: what its hash was made from

    def blocks_for(self, num_tokens: int) -> int: ...


class LedgerAudit:
    """The audit of one ledger, composed into it: `check` is `BlockManager.audit`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # hash -> the (parent hash, tokens) key object last hashed to it: an unchanged key (the same immutable
        # tuple) need not be hashed again on every audit
        self._audited_keys: dict[int, BlockKey] = {}

    def check(self, computed_tokens: Mapping[str, int], token_ids: Mapping[str, Sequence[int]] | None = None) -> None:
        """Check every ledger and cache invariant; raises AuditError naming the first that fails.

        `computed_tokens` maps each live request to its computed tokens; `token_ids`, when given,
        maps live requests to their tokens, against which the cached blocks they hold are checked.
        """
        ledger = self.ledger
        self._audit_pool()
        self._audit_cache()
        for request_id in ledger.tables.keys() - computed_tokens.keys():
            raise AuditError(f"blocks held by {request_id!r}, which is not a live request")
        for request_id, num_computed in computed_tokens.items():
            table = ledger.tables.get(request_id, [])
            want = ledger.blocks_for(num_computed)
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
        ledger = self.ledger
        refs, hash_of = ledger.ref_counts, ledger.block_hashes
        holders = [0] * ledger.num_blocks
        for table in ledger.tables.values():
            if len(set(table)) != len(table):
                return False
            for block_id in table:
                holders[block_id] += 1
        if holders != refs:
            return False
        free_set, cached_free_set = set(ledger.free_block_ids), set(ledger.cached_free_block_ids)
        unowned = {block_id for block_id, n in enumerate(refs) if n == 0}
        return (
            len(free_set) == len(ledger.free_block_ids)
            and not free_set & cached_free_set
            and free_set | cached_free_set == unowned
            and all(hash_of[block_id] is None for block_id in free_set)
            and all(hash_of[block_id] is not None for block_id in cached_free_set)
            and all(hash_of[block_id] is not None for block_id, n in enumerate(refs) if n > 1)
        )

    def _explain_pool(self) -> None:
        """The pool checks block by block, raising AuditError naming the first that fails."""
        ledger = self.ledger
        free, cached_free = list(ledger.free_block_ids), list(ledger.cached_free_block_ids)
        free_set, cached_free_set = set(free), set(cached_free)
        if len(free_set) != len(free):
            raise AuditError("a block is on the free list twice")
        if free_set & cached_free_set:
            raise AuditError(f"blocks {sorted(free_set & cached_free_set)} are both truly free and cached-free")
        holders = [0] * ledger.num_blocks
        for request_id, table in ledger.tables.items():
            if len(set(table)) != len(table):
                raise AuditError(f"request {request_id!r} holds a block twice: {table}")
            for block_id in table:
                holders[block_id] += 1
        for block_id in range(ledger.num_blocks):
            refs, hashed = ledger.ref_counts[block_id], ledger.block_hashes[block_id] is not None
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
        num_used = sum(1 for refs in ledger.ref_counts if refs)
        if len(free) + len(cached_free) + num_used != ledger.num_blocks:
            raise AuditError(
                f"free {len(free)} + cached-free {len(cached_free)} + used {num_used} != total {ledger.num_blocks}"
            )

    def _audit_cache(self) -> None:
        ledger = self.ledger
        if not ledger.enable_prefix_caching and ledger.cached_blocks:
            raise AuditError("blocks are cached with prefix caching off")
        carried = {h: block_id for block_id, h in enumerate(ledger.block_hashes) if h is not None}
        if len(carried) != len(ledger.block_hashes) - ledger.block_hashes.count(None) or carried != ledger.cached_blocks:
            self._explain_carriers()
        self._audit_cached_keys()

    def _explain_carriers(self) -> None:
        """Hash carriers against the cache map, raising AuditError naming the first mismatch."""
        ledger = self.ledger
        carriers: dict[int, list[int]] = {}
        for block_id, h in enumerate(ledger.block_hashes):
            if h is not None:
                carriers.setdefault(h, []).append(block_id)
        for h, blocks in carriers.items():
            if len(blocks) > 1:
                raise AuditError(f"hash {h:#x} maps to blocks {blocks}")
            if ledger.cached_blocks.get(h) != blocks[0]:
                raise AuditError(f"block {blocks[0]} carries hash {h:#x}, which the cache does not map to it")
        if len(ledger.cached_blocks) != len(carriers):
            raise AuditError(f"the cache maps {len(ledger.cached_blocks)} hashes but {len(carriers)} blocks carry one")

    def _audit_cached_keys(self) -> None:
        """Every cached block's stored (parent, tokens) hashes to its hash; a key already checked is not rehashed."""
        ledger = self.ledger
        audited, self._audited_keys = self._audited_keys, {}
        for h, block_id in ledger.cached_blocks.items():
            key = ledger.block_keys[block_id]
            if key is None or audited.get(h) is not key:
                if key is None or len(key[1]) != ledger.block_size or hashing.hash_block(*key) != h:
                    raise AuditError(f"block {block_id}'s hash does not match the tokens it holds")
            self._audited_keys[h] = key

    def _audit_held_cached_blocks(
        self, request_id: str, table: Sequence[int], num_computed: int, tokens: Sequence[int] | None
    ) -> None:
        ledger = self.ledger
        bs = ledger.block_size
        for i, block_id in enumerate(table):
            h = ledger.block_hashes[block_id]
            if h is None:
                continue
            if (i + 1) * bs > num_computed:
                raise AuditError(f"request {request_id!r} is still writing block {block_id}, which is cached")
            parent, stored = ledger.block_keys[block_id]
            if tokens is not None and tuple(tokens[i * bs : (i + 1) * bs]) != stored:
                raise AuditError(f"request {request_id!r} holds cached block {block_id}, whose tokens are not its own")
            if i > 0 and ledger.block_hashes[table[i - 1]] not in (None, parent):
                raise AuditError(f"request {request_id!r}: cached block {block_id} does not chain from the block before")
