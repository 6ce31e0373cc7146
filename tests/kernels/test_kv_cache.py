"""The paged cache layout: allocation, write_kv through slots, and the gathers the CPU kernels use."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.kv_cache import allocate_kv_cache, gather_contexts, gather_positions, write_kv
from pagoda.kernels.metadata import AttentionMetadata
from pagoda.kernels.workspace import Workspace


def test_write_kv_fills_exactly_the_mapped_slots():
    k_cache, v_cache = allocate_kv_cache(6, 4, 2, 8)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    meta = AttentionMetadata.build([3, 1], [5, 2], [[5, 1], [3]], 4)  # seq 0 positions 2..4, seq 1 position 1
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    assert torch.equal(k_cache[5, 2], k[0]) and torch.equal(k_cache[5, 3], k[1])
    assert torch.equal(k_cache[1, 0], k[2]) and torch.equal(v_cache[3, 1], v[3])
    assert int(torch.isfinite(k_cache).all(-1).all(-1).sum()) == 4  # nothing else was touched


def test_write_kv_checks_shapes():
    k_cache, v_cache = allocate_kv_cache(2, 4, 2, 8)
    with pytest.raises(ValueError, match="kv heads"):
        write_kv(k_cache, v_cache, torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k_cache, v_cache, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.tensor([0]))


def test_allocate_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        allocate_kv_cache(4, 0, 2, 8)


@pytest.mark.parametrize("block_size", [1, 4, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_contexts_reads_positions_and_zeroes_the_rest(block_size, dtype):
    lens = [5, 50, 1]
    tables = [[3], [0, 2], [1]] if block_size == 48 else None
    if tables is None:
        order = torch.randperm(sum(-(-n // block_size) for n in lens) + 2).tolist()
        tables = []
        for n in lens:
            tables.append(order[: -(-n // block_size)])
            order = order[len(tables[-1]) :]
    num_blocks = max(max(t) for t in tables) + 1
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, 2, 8, dtype)
    k_cache.fill_(float("nan"))
    v_cache.copy_(torch.randn_like(v_cache, dtype=torch.float32).to(dtype))
    meta = AttentionMetadata.build(lens, lens, tables, block_size)
    write_kv(k_cache, v_cache, torch.randn(sum(lens), 2, 8).to(dtype), torch.randn(sum(lens), 2, 8).to(dtype),
             meta.slot_mapping)  # fmt: skip
    length = 64
    k, v = gather_contexts(k_cache, v_cache, meta.block_tables, lens, length, Workspace())
    assert k.shape == (3, length, 2, 8) and k.dtype == torch.float32  # [N, L, KVH, D]
    for b, n in enumerate(lens):
        assert torch.equal(k[b, :n], gather_positions(k_cache, meta.block_tables[b], n).float())
        assert torch.equal(v[b, :n], gather_positions(v_cache, meta.block_tables[b], n).float())
        assert not k[b, n:].any() and not v[b, n:].any()  # zeros, not NaN or another sequence's data
    # a window that starts past the shortest sequence's end
    k2, _ = gather_contexts(k_cache, v_cache, meta.block_tables, lens, 48, Workspace(), start=48)
    assert torch.equal(k2[1, :2], k[1, 48:50]) and not k2[0].any() and not k2[1, 2:].any()
