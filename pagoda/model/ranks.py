"""Starting a tensor-parallel group, and the worker ranks' loop.

Two ways to start the ranks, one code path after:

- One machine: `pagoda serve --tensor-parallel-size N` is rank 0 and spawns ranks 1..N-1 itself
  (torch.multiprocessing, spawn). Rank 0 opens the rendezvous (a TCPStore on 127.0.0.1, on a port
  the kernel picks) and passes its port to the ranks it spawns.
- Across machines: torchrun starts one `pagoda serve` per rank and sets RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the group forms from that environment (`env://`). Rank 0
  serves HTTP; every other rank becomes a worker (`serve_as_worker`).

Either way each rank runs on an equal share of its machine's torch threads, as pagoda/core/machine.py
decides (`threads_per_process` of the ranks on the machine): rank 0 works it out for the ranks it spawns.
Rank 0 puts its own count back when its group ends (a library or test process outlives its group).

Every rank then loads its own shard (pagoda/model/shard.py) and the worker ranks loop on
rank 0's messages: an `EngineConfig` (a runner with a new KV pool: rank 0 sends one whenever it
makes a runner), a `StepPlan` (run it and take part in its collectives), or None (the end),
until the end or a failed group.

Faults (docs/distributed.md). A collective that fails (a peer's connection closed, or no answer
within --distributed-timeout) raises GroupFailure on whichever rank runs it. Rank 0 also watches
the processes it spawned, so a rank that dies while the server is idle is noticed at once, not
at the next request. A failed group is torn down, rank 0 kills the ranks it spawned, and
every rank exits: a worker with status 1; rank 0's server says why on /health, then exits too.
A worker ignores SIGINT and SIGTERM: rank 0 gets them too, drains (its steps need every rank), then
ends the group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagoda.distributed")

BACKENDS = ("gloo", "nccl")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
JOIN_TIMEOUT_S = 10.0  # how long a closing rank 0 waits for the ranks it spawned to exit before killing them


@dataclass(frozen=True)
class ParallelOptions:
    """--tensor-parallel-size, --distributed-backend (None: gloo on CPU, NCCL on CUDA), --distributed-timeout."""

    tensor_parallel_size: int = 1
    backend: str | None = None
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"distributed_backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.timeout_s!r}")

    def backend_for(self, device_type: str) -> str:
        backend = self.backend or ("nccl" if device_type == "cuda" else "gloo")
        if backend == "nccl" and device_type != "cuda":
            raise ValueError("distributed_backend nccl needs CUDA devices; use gloo on the CPU")
        if backend == "gloo" and device_type == "cuda":
            raise ValueError("distributed_backend gloo carries CPU tensors; use nccl between CUDA devices")
        return backend


@dataclass(frozen=True)
class TorchrunRank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_rank(environ: dict[str, str] | None = None) -> TorchrunRank | None:
    """This process's rank when torchrun (or any env:// launcher) started it, else None."""
    env = os.environ if environ is None else environ
    if not all(name in env for name in TORCHRUN_ENV):
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunRank(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))))


def group_size(options: ParallelOptions, environ: dict[str, str] | None = None) -> int:
    """The group's size: torchrun's world when it started us (it must agree with --tensor-parallel-size > 1)."""
    launched = torchrun_rank(environ)
    if launched is None:
        return options.tensor_parallel_size
    if options.tensor_parallel_size not in (1, launched.world_size):
        raise ValueError(f"--tensor-parallel-size {options.tensor_parallel_size} differs from torchrun's "
                         f"WORLD_SIZE {launched.world_size}")
    return launched.world_size


def _ignore_stop_signals() -> None:
    """A worker ends when rank 0 says so, not on a signal: a Ctrl-C (sent to the whole process group) or
    torchrun's SIGTERM reaches rank 0 too, which drains, running steps that need every rank, and then ends
    the group. If rank 0 is gone instead, the worker's next collective fails, and it exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Ranks:
    """Rank 0's hold on its group: the group, the ranks it spawned (none under torchrun), their watch."""

    def __init__(self, group: Any | None, processes: list[Any], threads_before: int | None = None) -> None:
        self.group = group
        self.processes = processes
        self._threads_before = threads_before
        self._closing = False
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one close at a time (the engine loop's and the server's own)

    @classmethod
    def start(cls, options: ParallelOptions, device_type: str, worker: WorkerSpec) -> Ranks:
        """Form the group as its rank 0: join torchrun's, or spawn ranks 1..N-1 on this machine."""
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from pagoda.core.machine import children_wait_passive, configure_threads, threads_per_process
        from pagoda.distributed.group import FORM_TIMEOUT, TensorGroup

        backend = options.backend_for(device_type)
        launched = torchrun_rank()
        if launched is not None:
            before = torch.get_num_threads()
            configure_threads(threads_per_process(launched.local_world_size))
            if backend == "nccl":
                torch.cuda.set_device(launched.local_rank)
            return cls(TensorGroup.form(backend, 0, launched.world_size, options.timeout_s), [], before)
        size = options.tensor_parallel_size
        if backend == "nccl" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices; torch sees "
                             f"{torch.cuda.device_count()}")
        threads = threads_per_process(size)  # each rank's, this one's too
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=FORM_TIMEOUT, wait_for_workers=False)
        context = mp.get_context("spawn")
        spec = dataclasses.replace(worker, backend=backend, size=size, store_port=store.port, threads=threads,
                                   timeout_s=options.timeout_s, log_level=logging.getLogger().getEffectiveLevel())
        processes = [context.Process(target=spawned_worker, args=(spec, rank), name=f"pagoda-rank-{rank}",
                                     daemon=True) for rank in range(1, size)]
        with children_wait_passive():
            for p in processes:
                p.start()
        before = torch.get_num_threads()
        configure_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(0)
        ranks = cls(None, processes, before)
        try:
            ranks.group = ranks._form_watching(lambda: TensorGroup.form(backend, 0, size, options.timeout_s, store))
        except BaseException:
            ranks.close()
            raise
        for rank, p in enumerate(processes, start=1):
            logger.info("tensor parallel: rank %d of %d is pid %d", rank, size, p.pid)
        return ranks

    def _form_watching(self, form: Callable[[], Any]) -> Any:
        """`form()` on a thread, while watching the spawned ranks: one that exits before the group has formed
        (an import error, a device it cannot take) is a start-up error now, not after FORM_TIMEOUT."""
        if not self.processes:
            return form()
        result: list[Any] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                result.append(form())
            except BaseException as exc:
                failure.append(exc)

        former = threading.Thread(target=run, name="pagoda-rank-form", daemon=True)
        former.start()
        sentinels = {p.sentinel: p for p in self.processes}
        while former.is_alive():
            ready = wait(list(sentinels), timeout=0.5)  # a rank's end, or half a second to look at the former again
            if ready and former.is_alive():
                gone = sentinels[ready[0]]
                gone.join(JOIN_TIMEOUT_S)
                raise ValueError(f"tensor-parallel rank {self.processes.index(gone) + 1} exited with code "
                                 f"{gone.exitcode} before the group formed (its log says why)")
        if failure:
            raise failure[0]
        return result[0]

    def describe(self) -> dict[str, Any]:
        """The group for /health: its size, backend and the pids of the ranks this process spawned."""
        return {"size": self.group.size, "backend": self.group.backend,
                "pids": [os.getpid(), *(p.pid for p in self.processes)]}

    def watch(self, on_lost: Callable[[Exception], None]) -> None:
        """Call `on_lost(GroupFailure)` from a watcher thread when a rank this process spawned exits unasked."""
        if not self.processes:
            return  # torchrun's ranks are watched by torchrun (it stops the others) and by the collectives

        def watcher() -> None:
            from pagoda.distributed.group import GroupFailure

            by_sentinel = {p.sentinel: p for p in self.processes}
            ready = wait(list(by_sentinel))  # a sentinel is ready once its process's end closed it
            if self._closing:
                return
            gone = by_sentinel[ready[0]]
            gone.join(JOIN_TIMEOUT_S)  # reaped: its exit code (the pipe closes a moment before the process is done)
            failure = GroupFailure(f"tensor-parallel rank {self.processes.index(gone) + 1} (pid {gone.pid}) "
                                   f"exited with code {gone.exitcode}")
            self.group.failure = self.group.failure or failure
            logger.error("%s", failure)
            on_lost(failure)

        threading.Thread(target=watcher, name="pagoda-rank-watch", daemon=True).start()

    def close(self, abandon: bool = False) -> None:
        """End the group: tell the ranks to stop (if it still works), tear it down, and reap what was spawned.

        `abandon`: another thread is inside the group's collectives; the ranks are killed, and the group is
        neither told nor torn down under it (the process is about to exit)."""
        with self._lock:
            self._close(abandon)

    def _close(self, abandon: bool) -> None:
        from pagoda.core.machine import configure_threads

        if self._closed.is_set():
            return
        self._closing = True
        failed = self.group is None or self.group.failure is not None or abandon
        if not failed:
            try:
                self.group.broadcast(None)  # the end
            except Exception:
                logger.warning("tensor parallel: the ranks could not be told to stop", exc_info=True)
                failed = True
        if self.group is not None and not abandon:
            self.group.close()
        for p in self.processes:  # workers ignore SIGTERM (`_ignore_stop_signals`): one that lingers is killed
            if failed:
                p.kill()  # a failed group's ranks have nothing left to do
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        if self._threads_before is not None:
            configure_threads(self._threads_before)
        self._closed.set()


@contextmanager
def sharded_model(model_dir: Path | str, options: Any, device_type: str = "cpu") -> Iterator[tuple[Any, Ranks]]:
    """Rank 0's shard of the model in `model_dir` and the `Ranks` holding the rest, for the length of a `with`
    (benchmarks and tests: an engine made over it needs `make_engine(..., ranks=ranks)`). `options` are
    EngineOptions, the same for every rank."""
    from pagoda.model.loader import load_shard

    ranks = Ranks.start(options.parallel, device_type, WorkerSpec(str(model_dir), options))
    try:
        yield load_shard(Path(model_dir), options, ranks.group, 0), ranks
    finally:
        ranks.close()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to load its shard and join the group (picklable: it crosses a spawn)."""

    model_dir: str
    options: Any  # pagoda.model.factory.EngineOptions
    backend: str = "gloo"
    size: int = 1
    store_port: int = 0
    threads: int = 1
    timeout_s: float = 60.0
    log_level: int = logging.INFO  # rank 0's, for the spawned ranks' log


def spawned_worker(spec: WorkerSpec, rank: int) -> None:
    """The entry of a rank rank 0 spawned: join the group through rank 0's store, then work until told to stop."""
    from pagoda.core.machine import configure_threads, prepare_process

    prepare_process()  # as in every pagoda process (torch came with the arguments, under children_wait_passive)
    import torch
    import torch.distributed as dist

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    from pagoda.distributed.group import FORM_TIMEOUT, TensorGroup

    _ignore_stop_signals()
    configure_threads(spec.threads)  # rank 0's share for it (Ranks.start)
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)  # one machine: rank r on cuda:r (NCCL's collectives use the current device)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False, timeout=FORM_TIMEOUT)
    group = TensorGroup.form(spec.backend, rank, spec.size, spec.timeout_s, store)
    raise SystemExit(run_worker(group, spec, local_rank=rank))


def serve_as_worker(model_dir: Path | str, options: Any) -> int | None:
    """Under torchrun, on a rank other than 0: be a worker until the group ends, and return the exit status.

    None on rank 0 or outside torchrun: the caller goes on to build the engine (and serve)."""
    launched = torchrun_rank()
    if launched is None or launched.rank == 0:
        return None
    import torch

    from pagoda.core.machine import configure_threads, threads_per_process
    from pagoda.distributed.group import TensorGroup
    from pagoda.model.loader import resolve_device

    _ignore_stop_signals()
    parallel = options.parallel
    group_size(parallel)  # refuses a --tensor-parallel-size that disagrees with torchrun's world
    configure_threads(threads_per_process(launched.local_world_size))
    device = resolve_device(options.device)
    if device.type == "cuda":
        torch.cuda.set_device(launched.local_rank)
    backend = parallel.backend_for(device.type)
    group = TensorGroup.form(backend, launched.rank, launched.world_size, parallel.timeout_s)
    spec = WorkerSpec(model_dir=str(model_dir), options=options, backend=backend, size=launched.world_size,
                      timeout_s=parallel.timeout_s)
    return run_worker(group, spec, local_rank=launched.local_rank)


def run_worker(group: Any, spec: WorkerSpec, local_rank: int | None = None) -> int:
    """A worker rank of a formed `group`: load its shard, then follow rank 0's messages (a runner's configuration,
    step plans, the end); 0 when told to stop, 1 when the group failed."""
    from pagoda.core.engine_config import EngineConfig
    from pagoda.distributed.group import GroupFailure
    from pagoda.model.loader import load_shard
    from pagoda.model.runner import AdapterChange, TorchModelRunner

    rank = group.rank
    try:
        model = load_shard(Path(spec.model_dir), spec.options, group, local_rank)
        runner = None
        while (message := group.broadcast()) is not None:
            if isinstance(message, EngineConfig):  # rank 0 made a runner: this rank's share of its KV pool
                runner = TorchModelRunner(model, message)
                logger.info("tensor parallel: rank %d of %d holds %d of %d KV heads; %d KV blocks", rank, spec.size,
                            model.shard.num_kv_heads, model.config.num_key_value_heads, message.num_blocks)
            elif isinstance(message, AdapterChange):  # a LoRA adapter loaded or unloaded on rank 0
                runner.change_adapter(message)
            else:
                runner.run(message)
        return 0
    except GroupFailure as exc:
        logger.error("%s; this rank exits", exc)
        return 1
    except Exception:
        logger.exception("tensor-parallel rank %d failed; it exits", rank)
        return 1
    finally:
        group.close()
