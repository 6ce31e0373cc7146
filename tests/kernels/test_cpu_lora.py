"""pagoda's C++ LoRA kernel (cpu_lora.cpp): each row's delta against the plain formula, and its bits the same
whatever the other rows, their adapters, the row count and the thread count."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"{cpu_native.load()}")


def adapters(k, n, ranks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, k, generator=gen), torch.randn(r, n, generator=gen)) for r in ranks]


def table_of(pairs):
    """[slots, 1, 3]: one projection."""
    return torch.tensor([[[a.data_ptr(), bt.data_ptr(), a.shape[0]]] for a, bt in pairs], dtype=torch.int64)


def apply(base, x, pairs, slots, threads=1):
    out = base.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_native.lora_apply(out, x, table_of(pairs), 0, torch.tensor(slots, dtype=torch.int64))
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("k, n", [(64, 96), (61, 203), (576, 960), (8, 8)])
def test_each_row_adds_its_own_adapters_delta(k, n):
    pairs = adapters(k, n, [8, 16, 3, 0])  # rank 0: the adapter leaves this projection alone
    gen = torch.Generator().manual_seed(1)
    x, base = torch.randn(11, k, generator=gen), torch.randn(11, n, generator=gen)
    slots = [0, -1, 1, 2, 0, 3, 1, -1, 2, 2, 0]
    out = apply(base, x, pairs, slots)
    for t, s in enumerate(slots):
        if s < 0 or pairs[s][0].numel() == 0:
            assert torch.equal(out[t], base[t])
            continue
        a, bt = pairs[s]
        expected = base[t].double() + (x[t].double() @ a.double().T) @ bt.double()
        torch.testing.assert_close(out[t].double(), expected, rtol=1e-5, atol=1e-4)


def test_a_rows_bits_depend_on_nothing_else():
    k, n = 200, 330
    pairs = adapters(k, n, [16, 8, 4])
    gen = torch.Generator().manual_seed(2)
    x, base = torch.randn(64, k, generator=gen), torch.randn(64, n, generator=gen)
    slots = [t % 4 - 1 for t in range(64)]
    crowd = apply(base, x, pairs, slots, threads=2)
    assert torch.equal(apply(base, x, pairs, slots, threads=1), crowd)
    for t in range(0, 64, 5):
        alone = apply(base[t : t + 1], x[t : t + 1], pairs, slots[t : t + 1])
        assert torch.equal(alone[0], crowd[t]), f"row {t} differs from itself alone"
    # row 9 (adapter 0) again, in slot 1 of a table in another order, between rows of other adapters
    moved = apply(base[[9, 9, 9]], x[[3, 9, 5]].contiguous(), [pairs[2], pairs[0], pairs[1]], [0, 1, 2])
    assert torch.equal(moved[1], crowd[9])


def test_a_slot_past_the_table_is_refused():
    pairs = adapters(16, 16, [4])
    with pytest.raises(RuntimeError, match="slot"):
        apply(torch.zeros(2, 16), torch.zeros(2, 16), pairs, [0, 1])
