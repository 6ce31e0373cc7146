"""The all-reduce beyond two ranks, in both its forms, on three real gloo ranks: the same bits on every rank,
equal to the sum in rank order, whether the buffer goes whole or in parts, padding included."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path

import pytest
import torch

SHAPES = [(1, 7), (4, 576), (5, 577), (33, 1001)]  # element counts that 3 does and does not divide


def values(rank: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + shape[0] * shape[1]))


def rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from pagoda.distributed.group import TensorGroup

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=120))
    group = TensorGroup.form("gloo", rank, 3, 60, store)
    try:
        results = {}
        for shape in SHAPES:
            x = values(rank, shape)
            results[shape] = (group._sum_whole(x), group._sum_parts(x), group.all_reduce(x))
        torch.save(results, Path(out) / f"{rank}.pt")
    finally:
        group.close()


@pytest.mark.slow
def test_three_ranks_sum_in_rank_order_whole_or_in_parts(tmp_path):
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(r, master.port, str(tmp_path))) for r in range(3)]
    # rank 0's store is the one made here: the ranks join it as clients
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(3)]
    for shape in SHAPES:
        expected = values(0, shape).clone().add_(values(1, shape)).add_(values(2, shape))  # ((x0 + x1) + x2)
        for whole, parts, chosen in (r[shape] for r in results):
            assert torch.equal(whole, expected) and torch.equal(parts, expected) and torch.equal(chosen, expected)
