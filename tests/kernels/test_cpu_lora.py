"""pagoda's C++ LoRA kernel (cpu_lora.cpp): each row's delta against the plain formula, and its bits the same
whatever the other rows, their adapters, the row count and the thread count."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native
from pagoda.model.lora import SegmentDelta

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")


def adapters(k, n, ranks, seed=0, parts=1):
    """Deltas of a projection [k -> n]: each of `parts` equal parts of its columns adapted at the given rank (0:
    that adapter leaves the projection alone)."""
    gen = torch.Generator().manual_seed(seed)
    width = n // parts
    out = []
    for r in ranks:
        out.append(None if r == 0 else SegmentDelta.of([(torch.randn(r, k, generator=gen),
                                                         torch.randn(width, r, generator=gen), p * width)
                                                        for p in range(parts)]))
    return out


def table_of(deltas):
    """[slots, 1, 3]: one projection."""
    return torch.tensor([[[0, 0, 0] if d is None else [d.desc.data_ptr(), len(d.segments), d.rank]]
                         for d in deltas], dtype=torch.int64)


def apply(base, x, deltas, slots, threads=1):
    out = base.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_native.lora_apply(out, x, table_of(deltas), 0, torch.tensor(slots, dtype=torch.int64),
                              torch.empty(len(slots), 3 * 64))
    finally:
        torch.set_num_threads(before)
    return out


def expected_row(base_row, x_row, delta):
    out = base_row.double().clone()
    for a, bt, offset in delta.segments:
        out[offset : offset + bt.shape[1]] += (x_row.double() @ a.double().T) @ bt.double()
    return out


@pytest.mark.parametrize("k, n, parts", [(64, 96, 1), (61, 203, 1), (576, 960, 3), (8, 8, 1), (100, 300, 2)])
def test_each_row_adds_its_own_adapters_delta(k, n, parts):
    deltas = adapters(k, n, [8, 16, 3, 0], parts=parts)
    gen = torch.Generator().manual_seed(1)
    x, base = torch.randn(11, k, generator=gen), torch.randn(11, n, generator=gen)
    slots = [0, -1, 1, 2, 0, 3, 1, -1, 2, 2, 0]
    out = apply(base, x, deltas, slots)
    for t, s in enumerate(slots):
        if s < 0 or deltas[s] is None:
            assert torch.equal(out[t], base[t])
        else:
            torch.testing.assert_close(out[t].double(), expected_row(base[t], x[t], deltas[s]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_rows_bits_depend_on_nothing_else(parts):
    k, n = 200, 330
    deltas = adapters(k, n, [16, 8, 5], parts=parts)
    gen = torch.Generator().manual_seed(2)
    x, base = torch.randn(64, k, generator=gen), torch.randn(64, n, generator=gen)
    slots = [t % 4 - 1 for t in range(64)]
    crowd = apply(base, x, deltas, slots, threads=2)
    assert torch.equal(apply(base, x, deltas, slots, threads=1), crowd)
    for t in range(0, 64, 5):
        alone = apply(base[t : t + 1], x[t : t + 1], deltas, slots[t : t + 1])
        assert torch.equal(alone[0], crowd[t]), f"row {t} differs from itself alone"
    # row 9 (adapter 0) again, in slot 1 of a table in another order, between rows of other adapters
    moved = apply(base[[9, 9, 9]], x[[3, 9, 5]].contiguous(), [deltas[2], deltas[0], deltas[1]], [0, 1, 2])
    assert torch.equal(moved[1], crowd[9])


def test_a_slot_past_the_table_or_a_small_scratch_is_refused():
    deltas = adapters(16, 16, [4])
    with pytest.raises(RuntimeError, match="slot"):
        apply(torch.zeros(2, 16), torch.zeros(2, 16), deltas, [0, 1])
    with pytest.raises(RuntimeError, match="scratch"):
        cpu_native.lora_apply(torch.zeros(1, 16), torch.zeros(1, 16), table_of(deltas), 0,
                              torch.zeros(1, dtype=torch.int64), torch.empty(1, 2))
