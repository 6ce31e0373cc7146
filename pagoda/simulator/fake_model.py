"""A fake model runner that still has to get the paged KV cache right.

It stores each computed token id in a slot of a flat "KV cache" through the
request's block table, and its logits for a sampling row are a deterministic
function of the context it reads back through that same table (the last
token and a checksum of the whole context). A request's distribution thus
depends only on its own tokens, as with a real model, and any ledger mistake
(a block handed to two requests, a stale table after preemption, a slot never
written) changes what the request reads and shows up as a mismatch against
its solo run, or as a read of a never-written slot, which raises.

Like the CPU matmuls it pads a step's rows to a multiple of 4 (`row_multiple`),
so greedy requests get n-gram drafts (core/speculative.py) in the padded rows:
a draft's row reads the context through the draft itself, so a rejected
draft's slot that is not rewritten before it is read changes the request.

Its vocabulary may be as wide as a real model's (a crowd recorded from real
traffic holds real token ids): the table keeps at most `TABLE_ROWS` rows, and a
context is keyed into one of them (the last token and the checksum, modulo the
rows), so a 128k vocabulary costs 128k columns, not 128k squared. Up to
`TABLE_ROWS` tokens the table is square and the key the plain token id.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pagoda.core.batch import SchedulerOutput
from pagoda.core.batch import RunnerOutput

EOS_TOKEN_ID = 0
TABLE_ROWS = 256  # the most rows of the logit table, whatever the vocabulary


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 256, seed: int = 0, eos_bias: float = 2.0,
                 row_multiple: int = 4):
        self.vocab_size = vocab_size
        self.row_multiple = row_multiple
        self.block_size = block_size
        self.cache = [-1] * (num_blocks * block_size)  # the token id stored in each slot
        self.num_table_rows = min(vocab_size, TABLE_ROWS)
        self.table = _logit_table(vocab_size, seed, eos_bias)  # [context key, vocab], read only
        self.table_rows = _table_rows(vocab_size, seed, eos_bias)  # its rows [1, vocab]: a list index, no tensor op

    def _write(self, block_table: tuple[int, ...], start: int, token_ids: list[int]) -> None:
        """Store tokens at positions start.. through the table, one block-sized slice at a time."""
        bs, cache, pos, done = self.block_size, self.cache, start, 0
        while done < len(token_ids):
            offset = pos % bs
            n = min(bs - offset, len(token_ids) - done)
            base = block_table[pos // bs] * bs + offset
            cache[base : base + n] = token_ids[done : done + n]
            pos, done = pos + n, done + n

    def _read(self, block_table: tuple[int, ...], end: int) -> list[int]:
        """The stored tokens of positions [0, end), gathered through the table block by block."""
        bs, cache = self.block_size, self.cache
        context: list[int] = []
        for i in range(-(-end // bs)):
            base = block_table[i] * bs
            context += cache[base : base + min(bs, end - i * bs)]
        return context

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Write each chunk's tokens into its slots, then read each logits row's whole context back."""
        for chunk in batch.chunks:
            self._write(chunk.block_table, chunk.start, chunk.token_ids)
        last, key = [], []
        for chunk in batch.logits_chunks:
            last_row = chunk.start + chunk.num_rows  # its logits rows are its last: prompt rows, last token, drafts
            for end in range(last_row - chunk.num_logits_rows + 1, last_row + 1):
                context = self._read(chunk.block_table, end)
                if min(context) < 0:
                    raise RuntimeError(f"request {chunk.request.request_id} read a KV slot that was never written")
                last.append(context[-1] % self.num_table_rows)
                key.append((sum(context) * 31 + end) % self.num_table_rows)
        if not last:
            return RunnerOutput(logits=torch.empty(0, self.vocab_size))
        # logits [rows, vocab] = table[last] + table[key]; the cheapest gather for each batch shape
        # (this is most of a simulated step), the same float additions either way
        if len(last) == 1:
            return RunnerOutput(logits=self.table_rows[last[0]] + self.table_rows[key[0]])
        rows = torch.index_select(self.table, 0, torch.tensor(last + key))
        return RunnerOutput(logits=rows[: len(last)] + rows[len(last) :])


@lru_cache(maxsize=8)
def _table_rows(vocab_size: int, seed: int, eos_bias: float) -> tuple[torch.Tensor, ...]:
    """The table's rows as [1, vocab] views, split once for every run that shares the table."""
    return _logit_table(vocab_size, seed, eos_bias).split(1)


@lru_cache(maxsize=8)
def _logit_table(vocab_size: int, seed: int, eos_bias: float) -> torch.Tensor:
    """The fake model's "weights": a fixed random table (shared by every run with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(min(vocab_size, TABLE_ROWS), vocab_size, generator=g) * 2.5
    table[:, EOS_TOKEN_ID] += eos_bias - 2.0  # EOS likely enough that some requests stop early
    return table
