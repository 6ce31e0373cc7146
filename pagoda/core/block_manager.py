"""The paged KV-cache ledger: which request owns which block.

The pool is `num_blocks` blocks of `block_size` token slots. A request's block
table lists its blocks in position order; slot `p` of a request lives in block
`table[p // block_size]` at offset `p % block_size`. Blocks carry reference
counts so that a block can later be shared between requests (prefix caching)
without changing the ledger: a block is free exactly when its count is zero.

This module is bookkeeping only: it never sees a tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class AuditError(AssertionError):
    """The ledger is inconsistent; the message says what failed."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    # -- counters --------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` slots."""
        return -(-num_tokens // self.block_size)

    # -- ownership changes ---------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can grow to cover `num_tokens` slots now."""
        return self._missing_blocks(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_tokens` slots; returns the table."""
        missing = self._missing_blocks(request_id, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"allocate({request_id!r}, {num_tokens}) needs {missing} blocks, {len(self._free)} free"
            )
        table = self._tables.setdefault(request_id, [])
        for _ in range(missing):  # usually zero or one
            block_id = self._free.popleft()
            assert self._ref_counts[block_id] == 0, f"free block {block_id} has references"
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return table

    def free(self, request_id: str) -> int:
        """Release every block the request holds; returns how many returned to the pool."""
        table = self._tables.pop(request_id, [])
        returned = 0
        for block_id in reversed(table):
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed with no references"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
                returned += 1
        return returned

    def _missing_blocks(self, request_id: str, num_tokens: int) -> int:
        # Called twice per request per step (check, then act): kept to plain arithmetic.
        table = self._tables.get(request_id)
        return max(0, (num_tokens + self.block_size - 1) // self.block_size - (len(table) if table else 0))

    # -- the one place the invariants are checked ----------------------
    def audit(self, computed_tokens: Mapping[str, int]) -> None:
        """Check every ledger invariant; `computed_tokens` maps each live request to its cached tokens.

        Raises AuditError naming the first invariant that fails.
        """
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            raise AuditError("a block is on the free list twice")
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AuditError(f"request {request_id!r} holds a block twice: {table}")
            for block_id in table:
                holders[block_id] += 1
        for block_id in range(self.num_blocks):
            refs = self._ref_counts[block_id]
            if refs != holders[block_id]:
                raise AuditError(f"block {block_id} has ref count {refs} but {holders[block_id]} holders")
            if refs > 1:
                raise AuditError(f"block {block_id} is owned by {refs} requests (no sharing is enabled)")
            if (block_id in free_set) == (refs > 0):
                state = "free and owned" if refs else "neither free nor owned"
                raise AuditError(f"block {block_id} is {state}")
        num_used = sum(1 for refs in self._ref_counts if refs)
        if len(free) + num_used != self.num_blocks:
            raise AuditError(f"free {len(free)} + used {num_used} != total {self.num_blocks}")
        for request_id in self._tables.keys() - computed_tokens.keys():
            raise AuditError(f"blocks held by {request_id!r}, which is not a live request")
        for request_id, num_computed in computed_tokens.items():
            have = len(self._tables.get(request_id, ()))
            want = self.blocks_for(num_computed)
            if have != want:
                raise AuditError(
                    f"request {request_id!r} has {num_computed} computed tokens but {have} blocks (want {want})"
                )
