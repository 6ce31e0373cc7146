"""The hand-offs of one step: what the scheduler gives the model runner, and what the runner returns.

A step is a flat list of chunks, one per scheduled request: `num_tokens`
consecutive tokens of the request starting at position `start` (the tokens
whose KV is not yet cached). A decode is a chunk of one token; a prefill or a
recompute after preemption is a longer chunk, possibly one of several. A
chunk that samples may carry draft tokens after its own (core/speculative.py):
the runner computes them in the rows that follow and returns a logits row for
the chunk's last token and for each draft. A chunk of a request that asked for
prompt logprobs also gets the logits of its prompt rows (`num_prompt_rows`),
just before those: every chunk's logits rows are the last rows it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from pagoda.core.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # position of the first new token == tokens already cached
    num_tokens: int  # new tokens computed this step (>= 1)
    block_table: tuple[int, ...]  # the request's blocks, covering start + num_rows slots
    draft_token_ids: tuple[int, ...] = ()  # proposed tokens after the request's last one, to verify
    num_prompt_rows: int = 0  # rows from `start` whose logits score the next prompt token (prompt logprobs)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_rows(self) -> int:
        """Token rows this step computes for the chunk: its own tokens, then its drafts."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows a sampling chunk samples from: its last token's, then one per draft."""
        return 1 + len(self.draft_token_ids)

    @property
    def num_logits_rows(self) -> int:
        """Logits rows the runner returns for the chunk, its last rows: its prompt rows, then its sample rows."""
        return self.num_prompt_rows + (self.num_sample_rows if self.samples else 0)

    @property
    def token_ids(self) -> list[int]:
        """The tokens of the chunk's rows (its own, then its drafts)."""
        own = self.request.token_ids_slice(self.start, self.end)
        return own + list(self.draft_token_ids) if self.draft_token_ids else own

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits pick the next one."""
        return self.end == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    block_size: int
    preempted_ids: list[str] = field(default_factory=list)

    # Read several times per step (engine, runner, sampler): computed once per batch.
    @cached_property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @cached_property
    def sample_chunks(self) -> list[ScheduledChunk]:
        """The chunks whose last position is sampled, in the order the runner returns logits."""
        return [c for c in self.chunks if c.samples]

    @cached_property
    def logits_chunks(self) -> list[ScheduledChunk]:
        """The chunks the runner returns logits rows for (`num_logits_rows` each), in its order."""
        return [c for c in self.chunks if c.num_logits_rows]

    @cached_property
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class RunnerOutput:
    # float32 tensor [sum of num_logits_rows over batch.logits_chunks, vocab_size], in that order: per chunk,
    # the logits at each of its prompt rows, then at its last position when it samples, then at each draft.
    logits: Any


class RunnerLost(RuntimeError):
    """The runner cannot run another step (a tensor-parallel rank is gone): the engine stops, not just the batch."""


class ModelRunner(Protocol):
    """What computes logits: the torch model runner and the simulator's fake model both implement it.

    A runner that holds more than its own process (a tensor-parallel group) may also have `close()`
    (end what it holds), `watch(on_lost)` (report a loss between steps) and `describe()` (its part of
    /health); the engine calls them where they exist.
    """

    vocab_size: int
    row_multiple: int  # the runner pads a step's rows to a multiple of this (1: no padding); drafts fill it

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Run one forward over the batch: write its new KV, return logits for the sampling chunks."""
        ...
