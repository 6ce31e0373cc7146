"""The paged KV cache layout shared by every attention backend.

Per layer, K and V are each one tensor [num_blocks, block_size, num_kv_heads, head_dim].
Token position `p` of a sequence lives in block `block_table[p // block_size]`
at offset `p % block_size`; its flat slot is `block_id * block_size + offset`.
A block holds whole positions with all heads side by side, so one slot write
stores a token's K (or V) for every head, and decode reads a block as one
contiguous run of block_size * num_kv_heads * head_dim values.
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
    """Allocate one layer's (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


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
    ws = workspace or Workspace()
    num_seqs, block_size = len(lens), k_cache.shape[1]
    if start % block_size:
        raise ValueError(f"start must be a multiple of the block size {block_size}, got {start}")
    num_blocks = -(-length // block_size)
    cols = torch.arange(start // block_size, start // block_size + num_blocks)
    cols = cols.clamp(max=block_tables.shape[1] - 1)  # past the table: zeroed below
    blocks = block_tables.to(torch.int64)[:, cols].flatten()  # [N * nb]
    gathered = []
    for name, cache in (("k", k_cache), ("v", v_cache)):
        # a block is one contiguous run of block_size * KVH * D values: index_select copies it whole
        raw = ws.get(name + "_raw", (blocks.numel(), *cache.shape[1:]), cache.dtype)
        torch.index_select(cache, 0, blocks, out=raw)
        if cache.dtype != torch.float32:
            raw = ws.get(name, raw.shape).copy_(raw)
        gathered.append(raw.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :length])
    k, v = gathered  # [N, length, KVH, D]
    # slots past a sequence's end hold other data or nothing (NaN, say): zero them so that a
    # masked score stays finite and a zero probability times V stays exactly zero
    first = max(0, min(min(lens) - start, length))
    beyond = torch.arange(start + first, start + length)[None, :] >= torch.tensor(lens)[:, None]
    k[:, first:].masked_fill_(beyond[:, :, None, None], 0.0)
    v[:, first:].masked_fill_(beyond[:, :, None, None], 0.0)
    return k, v
