"""A fake model runner that still has to get the paged KV cache right.

It stores each computed token id in a slot of a flat "KV cache" through the
request's block table, and its logits for a sampling row are a deterministic
function of the context it reads back through that same table (the last
token and a checksum of the whole context). A request's distribution thus
depends only on its own tokens, as with a real model, and any ledger mistake
(a block handed to two requests, a stale table after preemption, a slot never
written) changes what the request reads and shows up as a mismatch against
its solo run, or as a read of a never-written slot, which raises.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pagoda.core.batch import SchedulerOutput
from pagoda.core.batch import RunnerOutput

EOS_TOKEN_ID = 0


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 256, seed: int = 0, eos_bias: float = 2.0):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.cache = [-1] * (num_blocks * block_size)  # the token id stored in each slot
        self.table = _logit_table(vocab_size, seed, eos_bias)  # [context key, vocab], read only

    def _slots(self, block_table: tuple[int, ...], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Write each chunk's tokens into its slots, then read each sampling row's whole context back."""
        cache = self.cache
        for chunk in batch.chunks:
            for slot, token in zip(self._slots(chunk.block_table, chunk.start, chunk.end), chunk.token_ids):
                cache[slot] = token
        last, key = [], []
        for chunk in batch.sample_chunks:
            context = [cache[slot] for slot in self._slots(chunk.block_table, 0, chunk.end)]
            if min(context) < 0:
                raise RuntimeError(f"request {chunk.request.request_id} read a KV slot that was never written")
            last.append(context[-1])
            key.append((sum(context) * 31 + chunk.end) % self.vocab_size)
        if not last:
            return RunnerOutput(logits=torch.empty(0, self.vocab_size))
        return RunnerOutput(logits=self.table[torch.tensor(last)] + self.table[torch.tensor(key)])


@lru_cache(maxsize=8)
def _logit_table(vocab_size: int, seed: int, eos_bias: float) -> torch.Tensor:
    """The fake model's "weights": a fixed random table (shared by every run with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab_size, vocab_size, generator=g) * 2.5
    table[:, EOS_TOKEN_ID] += eos_bias - 2.0  # EOS likely enough that some requests stop early
    return table
