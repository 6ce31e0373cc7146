"""The all-reduce beyond two ranks, in both its forms, on three real gloo ranks: the same bits on every rank,
equal to the sum in rank order, whether the buffer goes whole or in parts, padding included. And forming a group:
NCCL's blocking wait is set while its groups are made, and the environment is put back after."""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from pagoda.distributed.group import BLOCKING_WAIT_ENV, TensorGroup

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


class FormRecorder:
    """torch.distributed's group making, replaced: what TORCH_NCCL_BLOCKING_WAIT was as each group was made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: str | None = None) -> None:
        import torch.distributed as dist

        self.seen: list[tuple[str, str | None]] = []
        self.fail_at = fail_at
        monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: self._made("default"))
        monkeypatch.setattr(dist, "new_group", lambda *a, backend=None, **k: self._made(backend))
        monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda *a: None)
        monkeypatch.setattr(dist, "destroy_process_group", lambda *a: self.seen.append(("destroyed", None)))

    def _made(self, name: str) -> str:
        self.seen.append((name, os.environ.get(BLOCKING_WAIT_ENV)))
        if name == self.fail_at:
            raise RuntimeError(f"{name} could not be made")
        return name


def test_nccl_groups_are_made_blocking_and_the_variable_is_gone_after(monkeypatch):
    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    made = FormRecorder(monkeypatch)
    group = TensorGroup.form("nccl", 0, 2, 30, store=object())
    assert made.seen == [("default", "1"), ("nccl", "1"), ("gloo", "1")]
    assert (group.compute, group.control) == ("nccl", "gloo")
    assert BLOCKING_WAIT_ENV not in os.environ  # a process started now inherits the user's environment


def test_a_group_that_fails_to_form_puts_the_variable_back_too(monkeypatch):
    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    made = FormRecorder(monkeypatch, fail_at="gloo")
    with pytest.raises(RuntimeError, match="could not be made"):
        TensorGroup.form("nccl", 0, 2, 30, store=object())
    assert made.seen[-1] == ("destroyed", None) and BLOCKING_WAIT_ENV not in os.environ


def test_a_blocking_wait_the_user_chose_wins_and_gloo_sets_nothing(monkeypatch):
    monkeypatch.setenv(BLOCKING_WAIT_ENV, "0")
    made = FormRecorder(monkeypatch)
    TensorGroup.form("nccl", 0, 2, 30, store=object())
    assert {value for _, value in made.seen} == {"0"} and os.environ[BLOCKING_WAIT_ENV] == "0"
    monkeypatch.delenv(BLOCKING_WAIT_ENV)
    made = FormRecorder(monkeypatch)
    TensorGroup.form("gloo", 0, 2, 30, store=object())
    assert {value for _, value in made.seen} == {None} and BLOCKING_WAIT_ENV not in os.environ
