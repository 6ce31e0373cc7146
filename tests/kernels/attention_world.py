"""A small world of sequences for attention tests: full Q/K/V histories and scattered block tables.

`World.batch(items)` plays one engine step: every cache slot is poisoned with
NaN, then exactly the positions each scheduled sequence has by the end of the
step are written through `write_kv` (as the runner does before attention), so
a kernel that reads an unwritten slot, or another sequence's block, gets NaN.
With `window=W` the positions before each item's earliest window start (its
first new token's position - W + 1) stay NaN too: a sliding-window kernel must
never read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagoda.kernels import AttentionMetadata, allocate_kv_cache, write_kv


@dataclass
class Step:
    q: Tensor  # [T, H, D]
    k_cache: Tensor
    v_cache: Tensor
    meta: AttentionMetadata
    scale: float
    items: list[tuple[int, int, int]]  # (sequence, first new position, new tokens)

    def rows_of(self, j: int) -> slice:
        """Flat-token rows of item j."""
        start = self.meta.query_starts_cpu[j]
        return slice(start, start + self.meta.query_lens_cpu[j])


class World:
    def __init__(
        self,
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        spare_blocks: int = 7,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype, self.scale = block_size, dtype, head_dim**-0.5
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        blocks_each = [-(-n // block_size) for n in seq_lens]
        self.num_blocks = sum(blocks_each) + spare_blocks
        # scattered, non-contiguous blocks in a random order, block 0 included
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for n in blocks_each:
            self.tables.append(order[:n])
            order = order[n:]
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]

    def batch(self, items: list[tuple[int, int, int]], device: str = "cpu", window: int = 0) -> Step:
        """One step computing tokens [start, start + n) of each (seq, start, n); caches poisoned elsewhere
        (and before each item's earliest window start, with window > 0)."""
        k_cache, v_cache = allocate_kv_cache(
            self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, device
        )
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        ends = [s + n for _, s, n in items]
        firsts = [max(0, s - window + 1) if window > 0 else 0 for _, s, _ in items]
        # the prefix each sequence has cached (from its earliest window start), plus this step's new tokens,
        # written as the runner would
        history = AttentionMetadata.build([e - f for e, f in zip(ends, firsts)], ends,
                                          [self.tables[i] for i, _, _ in items], self.block_size, device)
        write_kv(
            k_cache,
            v_cache,
            torch.cat([self.k[i][f:e] for (i, _, _), f, e in zip(items, firsts, ends)]).to(device),
            torch.cat([self.v[i][f:e] for (i, _, _), f, e in zip(items, firsts, ends)]).to(device),
            history.slot_mapping,
        )
        meta = AttentionMetadata.build(
            [n for _, _, n in items], ends, [self.tables[i] for i, _, _ in items], self.block_size, device
        )
        q = torch.cat([self.q[i][s : s + n] for i, s, n in items]).to(device)
        return Step(q, k_cache, v_cache, meta, self.scale, list(items))


def rel_err(out: Tensor, ref: Tensor) -> float:
    """Relative error per norm, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
