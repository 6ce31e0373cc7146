"""A tensor-parallel group: its ranks, the collectives one forward needs, and what they cost.

Three collectives, and a broadcast:

- `all_reduce(x)`, the sum of every rank's partial result (after the row-parallel o_proj and
  down_proj, and the vocab-parallel embedding). Batch invariance needs a sum whose order never
  depends on the batch, and a ring all-reduce's order does: gloo and NCCL cut the buffer into
  chunks by its size, and an element's order of summation depends on the chunk it falls in. So
  every element is summed in rank order, ((x0 + x1) + x2) + ..., whatever the buffer:
  - two ranks gather each other's partial result and both sum (one collective, a ring's bytes);
  - more ranks, on a buffer of at least SUM_PARTS_MIN_BYTES, split it into N parts: each rank
    receives every rank's values of one part (an all-to-all), sums them in rank order, and the sums
    go to every rank (an all-gather). Two collectives, 2(N-1)/N of the buffer sent, as a ring. A
    smaller buffer is gathered whole, as at two ranks: one collective's latency instead of two,
    where bytes cost little. Both give every element the same sum in the same order, so the choice
    by size (the same on every rank) never changes a bit.
- `gather_first(x, sizes)`, the vocab-parallel LM head's logits, concatenated on rank 0 only
  (the one that samples); shards of unequal size travel padded to the largest.
- `broadcast(obj)`, rank 0's step plan to every rank, one message a step.

Two process groups under one `TensorGroup` (`TensorGroup.form`), as vLLM keeps a CPU group beside
its device group. The compute group (gloo or NCCL) carries the forward's collectives and has
--distributed-timeout: a rank that does not answer within it inside a step has failed. The control
group (always gloo, on the CPU) carries the messages. A worker waits in it without a deadline: it
idles there between steps for as long as the server has no request, and while rank 0 loads its
shard. Rank 0's sends into it have --distributed-timeout (a hung worker must not hold rank 0 in a
send forever). A dead peer fails it at once (its connection closes).

A failed collective (a rank died, or it did not answer within the group's timeout) raises
`GroupFailure` and marks the group failed: it cannot be used again, and every rank exits
(docs/distributed.md, "When a rank fails").
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from pagoda.core.batch import RunnerLost
from pagoda.core.machine import environ_defaults

logger = logging.getLogger("pagoda.distributed")

# Beyond two ranks, a buffer this big is summed in parts (an all-to-all and an all-gather: a ring's bytes);
# a smaller one is gathered whole (one collective). 64 KiB: 29 rows of the default model's float32 hidden
# state, 8 of a 4096-wide bfloat16 one.
SUM_PARTS_MIN_BYTES = 64 << 10
# How long forming the group may take (every rank starts, imports torch and meets the others), and how long
# the control group's messages wait (an idle server's workers wait in it): no deadline worth the name.
FORM_TIMEOUT = timedelta(minutes=10)
CONTROL_TIMEOUT = timedelta(days=3650)
BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"  # read by each NCCL process group when it is made


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


def partition(n: int, size: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """The contiguous part [start, end) of n items that `rank` of `size` holds, in whole units of `unit` items:
    parts differ by at most one unit, and the last rank takes the n % unit items left over."""
    units, rest = divmod(n, unit)
    base, extra = divmod(units, size)
    start = (rank * base + min(rank, extra)) * unit
    end = start + (base + (rank < extra)) * unit
    return start, end + (rest if rank == size - 1 else 0)


class TensorGroup:
    """The ranks holding one model's shards, on a torch.distributed group of `backend`.

    Without a backend (`SOLO`) it is one process alone and runs no collective at all: the single-process
    path. A group of one with a backend runs every collective through torch.distributed, so one GPU can
    take the NCCL code path (`--distributed-backend nccl`)."""

    def __init__(self, rank: int = 0, size: int = 1, backend: str | None = None, *, compute: Any = None,
                 control: Any = None) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        self.communicates = backend is not None
        self.compute, self.control = compute, control  # torch.distributed groups (None: the default group)
        self.send_timeout = timedelta(seconds=60)  # how long rank 0 waits for a message to go out (`form` sets it)
        self.stats = CommStats()
        self.failure: GroupFailure | None = None
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    @classmethod
    def form(cls, backend: str, rank: int, size: int, timeout_s: float, store: Any = None) -> TensorGroup:
        """Join the group as `rank` of `size`: through `store` (rank 0's, on one machine) or the env:// variables
        torchrun sets. Every rank calls this, in the same order."""
        # NCCL: the host waits for each collective, so a timed-out one raises (GroupFailure) instead of NCCL's
        # watchdog aborting the process; it costs a host sync a collective (docs/distributed.md, "Left"). Each
        # NCCL process group reads the variable when it is made: set while they are (unless the user set it), then
        # the environment is put back, so a process started later inherits the user's.
        blocking = {BLOCKING_WAIT_ENV: "1"} if backend == "nccl" else {}
        where = {"store": store} if store is not None else {"init_method": "env://"}
        with environ_defaults(blocking):
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=FORM_TIMEOUT, **where)
            try:
                compute = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
                # formed within FORM_TIMEOUT like the rest (gloo connects its peers with the group's timeout), then
                # without a deadline for its messages
                control = dist.new_group(backend="gloo", timeout=FORM_TIMEOUT)
                dist.distributed_c10d._set_pg_timeout(CONTROL_TIMEOUT, control)
            except BaseException:
                dist.destroy_process_group()
                raise
        group = cls(rank, size, backend, compute=compute, control=control)
        group.send_timeout = timedelta(seconds=timeout_s)
        return group

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
        return self._sum_parts(x) if self.size > 2 and x.nbytes >= SUM_PARTS_MIN_BYTES else self._sum_whole(x)

    def _sum_whole(self, x: Tensor) -> Tensor:
        # every rank gathers every rank's buffer and sums them in rank order
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._run("all_reduce", x.nbytes, self._gather, gathered, x, group=self.compute)
        return _in_rank_order(gathered.view(self.size, *x.shape))

    def _sum_parts(self, x: Tensor) -> Tensor:
        # each rank sums one Nth of the buffer over the ranks, in rank order, then every part goes everywhere
        n, size = x.numel(), self.size
        part = -(-n // size)
        flat = x.new_zeros(part * size)
        flat[:n] = x.view(-1)
        received = torch.empty_like(flat)
        sent = flat.nbytes * (size - 1) // size
        # [rank r's values of my part], then every rank's sums
        self._run("all_reduce", sent, dist.all_to_all_single, received, flat, group=self.compute)
        whole = torch.empty_like(flat)
        self._run("all_reduce", sent, self._gather, whole, _in_rank_order(received.view(size, part)), group=self.compute)
        return whole[:n].view_as(x)

    def gather_first(self, x: Tensor, sizes: list[int]) -> Tensor | None:
        """x [S, sizes[rank]] on each rank -> [S, sum(sizes)] on rank 0 (None elsewhere), in rank order."""
        if not self.communicates:
            return x
        width = max(sizes)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)] if self.is_first else None
        self._run("gather", padded.nbytes, dist.gather, padded, parts, dst=0, group=self.compute)
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    def count(self, flag: int) -> int:
        """The sum of every rank's `flag` on every rank (a vote on the control group: how many ranks said 1); rank 0
        waits at most `send_timeout` for the others."""
        if not self.communicates:
            return flag
        votes = torch.tensor([flag], dtype=torch.int64)

        def vote() -> None:
            work = dist.all_reduce(votes, group=self.control, async_op=True)
            work.wait(timeout=self.send_timeout) if self.is_first else work.wait()

        self._run("count", votes.nbytes, vote)
        return int(votes.item())

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (one pickled message: its length, then its bytes)."""
        if not self.communicates:
            return obj
        return self._run("broadcast", 0, self._message, obj)

    def _message(self, obj: Any) -> Any:
        if self.is_first:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.empty(1, dtype=torch.int64)
        self._send_or_receive(length)
        if not self.is_first:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._send_or_receive(payload)
        return obj if self.is_first else pickle.loads(payload.numpy().tobytes())

    def _send_or_receive(self, tensor: Tensor) -> None:
        # rank 0 waits at most send_timeout for its message to go out; a worker waits for the next one for good
        work = dist.broadcast(tensor, src=0, group=self.control, async_op=True)
        if self.is_first:
            work.wait(timeout=self.send_timeout)
        else:
            work.wait()

    def close(self) -> None:
        """Tear the process group down (after a failure too: whatever the peers do)."""
        if self.communicates and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers are gone may not tear down cleanly; it is gone either way
                logger.debug("destroying the process group failed", exc_info=True)


def _in_rank_order(parts: Tensor) -> Tensor:
    """parts [N, ...] -> ((parts[0] + parts[1]) + parts[2]) + ...: one fixed order for every element."""
    total = parts[0].clone()
    for r in range(1, parts.shape[0]):
        total.add_(parts[r])
    return total


SOLO = TensorGroup()  # one process, one rank: the group a model has when nothing is sharded
