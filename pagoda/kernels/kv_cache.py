"""The paged KV cache layout shared by every attention backend, and the one way to read it in bulk.

Per layer, K and V are each one tensor [num_blocks, block_size, num_kv_heads, head_dim].
Token position `p` of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`; its flat slot is `block_id * block_size + offset`.
A block holds whole positions with all heads side by side, so one slot write
stores a token's K (or V) for every head, and decode reads a block as one
contiguous run of block_size * num_kv_heads * head_dim values.

`gather_blocks` is the CPU backends' read: whole blocks copied by one
`index_select`, the slots past each sequence's end zeroed. `gather_positions`
is the plain per-sequence read the reference oracle uses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagoda.kernels.workspace import Workspace


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor]:
    """Allocate one layer's zeroed (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    # zeros, not empty: a slot never written then reads as 0, never as what the allocator left there
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store the new tokens' K/V [T, num_kv_heads, head_dim] into their cache slots [T]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} do not fit a cache of "
            f"{num_kv_heads} kv heads x {head_dim}"
        )
    if k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    # view the cache as [num_slots, kv_heads, head_dim]: a slot is one token of one block
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_positions(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """Read positions [0, length) of one sequence: cache [N, bs, kvh, d], table [nb] -> [length, kvh, d]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.to(torch.int64)[pos // block_size]
    return cache[blocks, pos % block_size]


def window_blocks(block_tables: Tensor, start: int, length: int, block_size: int) -> Tensor:
    """The blocks holding positions [start, start + length) of N sequences: tables [N, W] -> [N * nb] int64.

    `start` is a multiple of block_size, `length` is rounded up to whole blocks; a column past a
    table's width reads its last entry (those slots are past the sequence's end, zeroed after the read).
    """
    first = start // block_size
    cols = torch.arange(first, first + -(-length // block_size)).clamp(max=block_tables.shape[1] - 1)
    return block_tables.to(torch.int64)[:, cols].flatten()


def slots_past_end(lens: list[int], start: int, length: int) -> Tensor | None:
    """[N, length] bool, True where position start + j is at or past sequence n's end; None if none is."""
    if min(lens) >= start + length:
        return None
    return torch.arange(start, start + length)[None, :] >= torch.tensor(lens)[:, None]


def gather_blocks(
    k_cache: Tensor, v_cache: Tensor, blocks: Tensor, num_seqs: int, past_end: Tensor | None, workspace: Workspace,
    zero_keys: bool = True,
) -> tuple[Tensor, Tensor]:
    """Read whole blocks [N * nb] as float32 [N, nb * block_size, KVH, D], zeroing the slots `past_end`.

    `past_end` ([P] int64 indices into the N * nb * block_size slots, or None) lists the slots at or
    past a sequence's end, which hold other data or nothing (NaN, say): zeros keep a masked score
    finite and 0 * V exactly 0. A caller that masks scores with `masked_fill_` (which also replaces
    a NaN) needs only V zeroed: `zero_keys=False` saves the K pass. The results are views of the
    workspace's buffers, valid until their next use.
    """
    gathered = []
    for name, cache in (("k", k_cache), ("v", v_cache)):
        # a block is one contiguous run of block_size * KVH * D values: index_select copies it whole
        raw = workspace.get(name + "_raw", (blocks.numel(), *cache.shape[1:]), cache.dtype)
        torch.index_select(cache, 0, blocks, out=raw)
        if cache.dtype != torch.float32:
            raw = workspace.get(name, raw.shape).copy_(raw)
        if past_end is not None and (zero_keys or name == "v"):  # whole slots: far faster than a broadcast mask
            raw.view(blocks.numel() * cache.shape[1], -1).index_fill_(0, past_end, 0.0)
        gathered.append(raw.view(num_seqs, -1, *cache.shape[2:]))
    return gathered[0], gathered[1]


def gather_contexts(
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    lens: list[int],
    length: int,
    workspace: Workspace | None = None,
    start: int = 0,
) -> tuple[Tensor, Tensor]:
    """Read positions [start, start + length) of N sequences as float32 [N, length, KVH, D], zero past each len.

    `start` must be a multiple of the block size. With a workspace the results are views of its
    buffers, valid until their next use.
    """
    block_size = k_cache.shape[1]
    if start % block_size:
        raise ValueError(f"start must be a multiple of the block size {block_size}, got {start}")
    span = -(-length // block_size) * block_size  # whole blocks
    hidden = slots_past_end(lens, start, span)
    past_end = None if hidden is None else hidden.flatten().nonzero().flatten()
    blocks = window_blocks(block_tables, start, span, block_size)
    k, v = gather_blocks(k_cache, v_cache, blocks, len(lens), past_end, workspace or Workspace())
    return k[:, :length], v[:, :length]
