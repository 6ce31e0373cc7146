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

import torch

from pagoda.core.batch import SchedulerOutput
from pagoda.core.model_runner import RunnerOutput

EOS_TOKEN_ID = 0


class FakeModelRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 256, seed: int = 0, eos_bias: float = 2.0):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.cache = torch.full((num_blocks * block_size,), -1, dtype=torch.long)  # token id per slot
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=g) * 2.5  # [context key, vocab]
        self.table[:, EOS_TOKEN_ID] += eos_bias - 2.0  # EOS likely enough that some requests stop early
        self._offsets = torch.arange(block_size)

    def _slots(self, block_table: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        blocks = torch.tensor(block_table, dtype=torch.long)
        return (blocks[:, None] * self.block_size + self._offsets).flatten()[start:end]

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Write each chunk's tokens into its slots, then read each sampling row's whole context back."""
        for chunk in batch.chunks:
            slots = self._slots(chunk.block_table, chunk.start, chunk.end)
            self.cache[slots] = torch.tensor(chunk.token_ids, dtype=torch.long)
        rows = []
        for chunk in batch.sample_chunks:
            context = self.cache[self._slots(chunk.block_table, 0, chunk.end)]
            if bool((context < 0).any()):
                raise RuntimeError(f"request {chunk.request.request_id} read a KV slot that was never written")
            key = (int(context.sum()) * 31 + chunk.end) % self.vocab_size
            rows.append(self.table[int(context[-1])] + self.table[key])
        logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
        return RunnerOutput(logits=logits)
