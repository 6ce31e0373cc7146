"""Per-step attention metadata: where each sequence's new tokens sit and which cache blocks it owns.

The flat token axis holds the new tokens of every scheduled sequence back to
back (a decode contributes one token, a prefill or recompute chunk several).
Sequence `b` owns tokens `query_start_loc[b]:query_start_loc[b+1]`, which sit
at positions `seq_lens[b] - query_len(b) .. seq_lens[b] - 1` of its context.

`AttentionMetadata.build` is the one constructor: the model runner calls it
every step, so it works from host lists with a handful of tensor ops and
no Python loop per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    query_start_loc: Tensor  # [B+1] int32: offsets of each sequence's new tokens in the flat token axis
    seq_lens: Tensor  # [B] int32: context length of each sequence after this step (cached + new)
    block_tables: Tensor  # [B, max_blocks_per_seq] int32, padded with 0 (padding is never read)
    slot_mapping: Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    positions: Tensor  # [T] int64: position of each new token in its sequence (what RoPE rotates by)
    # host copies: grid sizing and CPU loops without device syncs
    query_lens_cpu: list[int]  # [B]
    seq_lens_cpu: list[int]  # [B]
    query_start_loc_cpu: list[int]  # [B+1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def context_lens_cpu(self) -> list[int]:
        """Tokens already cached before this step, per sequence (position of the first new token)."""
        return [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @property
    def query_starts_cpu(self) -> list[int]:
        """Host copy of query_start_loc[:-1]."""
        return self.query_start_loc_cpu[:-1]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from host lists, computing each new token's position and cache slot."""
        query_lens, seq_lens = [int(n) for n in query_lens], [int(n) for n in seq_lens]
        _validate(query_lens, seq_lens, block_tables, block_size)
        num_seqs = len(seq_lens)
        starts = [0, *itertools.accumulate(query_lens)]
        width = max((len(t) for t in block_tables), default=0) or 1
        # one tensor from zero-padded host rows: cheaper than a copy per sequence
        rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
        table = torch.tensor(rows, dtype=torch.int64).view(num_seqs, width)
        # positions of the new tokens: seq_len - query_len + i, i in [0, query_len)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlens)  # [T]
        offset_in_seq = torch.arange(starts[-1]) - torch.tensor(starts[:-1], dtype=torch.int64)[seq_of_token]
        first_pos = torch.tensor(seq_lens, dtype=torch.int64) - qlens
        pos = first_pos[seq_of_token] + offset_in_seq  # [T]
        slots = table[seq_of_token, pos // block_size] * block_size + pos % block_size  # [T]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            block_tables=table.to(device=device, dtype=torch.int32),
            slot_mapping=slots.to(device),
            positions=pos.to(device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=starts,
        )


def _validate(
    query_lens: list[int], seq_lens: list[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError(
            f"query_lens, seq_lens and block_tables disagree on the number of sequences: "
            f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
        )
    for b, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if q < 1:
            raise ValueError(f"query_lens[{b}] must be >= 1, got {q}")
        if s < q:
            raise ValueError(f"seq_lens[{b}]={s} is shorter than query_lens[{b}]={q}")
        if len(blocks) * block_size < s:
            raise ValueError(f"block_tables[{b}] has {len(blocks)} blocks, too few for {s} tokens")
