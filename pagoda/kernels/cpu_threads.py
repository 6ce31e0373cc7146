"""How many OpenMP threads the CPU step's small work runs on: the one place that decides it.

Design note. The `pagoda` command makes waiting OpenMP threads sleep
(`OMP_WAIT_POLICY=PASSIVE`, `pagoda/cli/main.py`): on a shared CPU a spinning
pool collapses. The price is a futex wake-up of the sleeping worker in every
parallel region, 50-100 us on the 2-core CI machine, which is more than the
work itself for the small ops of a decode or a short prefill: a tiny attention
`bmm` took 52-121 us on 2 threads and 2-3 us on 1; RMSNorm's statistics over
64 rows 30-40 us on 2 threads, 10-18 us on 1; an elementwise op over
256 x 1536 values was still faster on one thread (measured, torch 2.13,
PASSIVE). So the step runs its elementwise work and its attention on one
thread while the work is small, and the matrix products of the linear layers,
which are big enough to share, on all threads (`wide` inside a
`few_threads` block). Switching costs about 0.3 us.

Thread counts never change a row's bits: elementwise ops compute each element
alone, reductions here run over a row's own last axis (torch splits outputs,
not a reduction, between threads), and the attention's matmuls have row
counts that MKL treats alike for 1 to 32 threads (`cpu_attention.py`); the
kernel tests run the attention at 1 and 4 threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

# a step of at most this many token rows runs its elementwise work on one thread (measured faster up to 256)
SMALL_ROWS = 256
# an attention fold with at most this many score elements runs on one thread (one chunk of a few prefills)
SMALL_SCORES = 1 << 19

T = TypeVar("T")
_outer = threading.local()  # per runner thread: the thread count `wide` restores


@contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block on n torch threads (n >= 1), restoring the previous count afterwards."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def few_threads(small: bool) -> Iterator[None]:
    """One thread for the block when its work is `small`; `wide` inside it restores the full count."""
    previous = getattr(_outer, "full", None)  # set when nested in another few_threads block
    full = torch.get_num_threads() if previous is None else previous
    _outer.full = full
    try:
        with threads(1 if small else full):
            yield
    finally:
        _outer.full = previous


def wide(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on all threads inside a `few_threads` block (no generator on the hot path)."""
    full = getattr(_outer, "full", None)
    now = torch.get_num_threads()
    if full is None or full == now:
        return fn(*args)
    torch.set_num_threads(full)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(now)


def small_step(rows: int) -> bool:
    """Whether a step of `rows` token rows is small enough for its elementwise work to run on one thread."""
    return rows <= SMALL_ROWS


def small_attention(max_scores: int) -> bool:
    """Whether attention folds of at most `max_scores` score elements are small enough for one thread."""
    return max_scores <= SMALL_SCORES
