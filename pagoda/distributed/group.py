"""A tensor-parallel group: its ranks, the collectives one forward needs, and what they cost.

Three collectives, and a broadcast:

- `all_reduce(x)`, the sum of every rank's partial result (after the row-parallel o_proj and
  down_proj, and the vocab-parallel embedding). Batch invariance needs a sum whose order never
  depends on the batch, and a ring all-reduce's order does: gloo and NCCL cut the buffer into
  chunks by its size, and an element's order of summation depends on the chunk it falls in. So the
  ranks gather every partial result (`all_gather`) and each sums them in rank order, one element
  at a time: ((x0 + x1) + x2) + ..., the same bits on every rank, for every row count. It moves
  (N-1)/N of N buffers, against a ring's 2(N-1)/N of one: the same bytes at N = 2, N/2 times
  more beyond (docs/distributed.md).
- `gather_first(x, sizes)`, the vocab-parallel LM head's logits, concatenated on rank 0 only
  (the one that samples); shards of unequal size travel padded to the largest.
- `broadcast(obj)`, rank 0's step plan to every rank, one message a step.

A failed collective (a rank died, or it did not answer within the group's timeout) raises
`GroupFailure` and marks the group failed: it cannot be used again, and every rank exits
(docs/distributed.md, "When a rank fails").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pagoda.core.batch import RunnerLost

logger = logging.getLogger("pagoda.distributed")


class GroupFailure(RunnerLost):
    """A rank of the tensor-parallel group is gone or did not answer in time: the group cannot go on."""


@dataclass
class CommStats:
    """Collectives run, bytes each rank sent into them, and the seconds they took, by kind."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.seconds.clear()


def partition(n: int, size: int, rank: int) -> tuple[int, int]:
    """The contiguous part [start, end) of n items that `rank` of `size` holds: sizes differ by at most one."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class TensorGroup:
    """The ranks holding one model's shards, on a torch.distributed group of `backend`.

    Without a backend (`SOLO`) it is one process alone and runs no collective at all: the single-process
    path. A group of one with a backend runs every collective through torch.distributed, so one GPU can
    take the NCCL code path (`--distributed-backend nccl`)."""

    def __init__(self, rank: int = 0, size: int = 1, backend: str | None = None) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        self.communicates = backend is not None
        self.stats = CommStats()
        self.failure: GroupFailure | None = None
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _run(self, kind: str, nbytes: int, op: Any, *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            raise self.failure
        started = time.perf_counter()
        try:
            result = op(*args, **kwargs)
        except Exception as exc:  # gloo: connection closed or timed out; NCCL: DistBackendError
            self.failure = GroupFailure(f"tensor-parallel {kind} failed on rank {self.rank} of {self.size}: {exc}")
            raise self.failure from exc
        self.stats.add(kind, nbytes, time.perf_counter() - started)
        return result

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's x, in rank order (the same bits on every rank, for every batch)."""
        if not self.communicates:
            return x
        x = x.contiguous()
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._run("all_reduce", x.nbytes, self._gather, gathered, x)
        parts = gathered.view(self.size, *x.shape)
        total = parts[0].clone()
        for r in range(1, self.size):
            total.add_(parts[r])
        return total

    def gather_first(self, x: Tensor, sizes: list[int]) -> Tensor | None:
        """x [S, sizes[rank]] on each rank -> [S, sum(sizes)] on rank 0 (None elsewhere), in rank order."""
        if not self.communicates:
            return x
        width = max(sizes)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_first else None
        self._run("gather", padded.nbytes, dist.gather, padded, parts, dst=0)
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (one pickled message)."""
        if not self.communicates:
            return obj
        box = [obj]
        self._run("broadcast", 0, dist.broadcast_object_list, box, src=0)
        return box[0]

    def close(self) -> None:
        """Tear the process group down (after a failure too: whatever the peers do)."""
        if self.communicates and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers are gone may not tear down cleanly; it is gone either way
                logger.debug("destroying the process group failed", exc_info=True)


SOLO = TensorGroup()  # one process, one rank: the group a model has when nothing is sharded
