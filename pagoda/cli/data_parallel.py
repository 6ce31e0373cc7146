"""`pagoda serve --data-parallel-size N`: N engine processes behind the router, from one command.

Design note. The process the user started loads no model: it supervises. It starts N replicas, each the
user's own `pagoda serve` command line with `--data-parallel-size 1 --host 127.0.0.1 --port 0` appended
(argparse keeps an option's last value, so every other option reaches a replica exactly as the user spelled
it, abbreviations and `=` included), reads each one's ready line for its URL, then starts `pagoda router`
over those URLs on the user's `--host`/`--port` and, once the router is ready, prints serve's own ready line
with the router's URL. Everything the children print goes to stderr, each line tagged with its child.

- Threads: each replica runs on its share of one `pagoda serve`'s torch threads (one per physical core),
  as pagoda/core/machine.py decides (`threads_per_process(N)`, handed over in the replica's environment
  by `threads_environ`), unless the user set OMP_NUM_THREADS (then every replica gets theirs). On CUDA
  each replica gets its own device through CUDA_VISIBLE_DEVICES.
- Orphans: each child runs in its own process group (a Ctrl-C at the terminal reaches the supervisor only,
  which drains the children in order), and on Linux with PR_SET_PDEATHSIG = SIGKILL, armed by a small
  trampoline (`python -m pagoda.cli.data_parallel PARENT_PID ARGV...`) that then execs `python -m pagoda`:
  if the supervisor dies, even by SIGKILL, the kernel kills its children. The trampoline rather than
  Popen's preexec_fn, which is unsafe once the supervisor has threads (its output readers).
- Failures: a child that exits before everything is ready fails the command (its status, or 1), with its
  own error on stderr; the others are stopped first. A replica that dies later is logged and not
  restarted (the router already routes around it); the command goes on while one replica is left, and exits
  1 when none is, or when the router dies.
- Stopping: SIGTERM or SIGINT sends SIGTERM to the router and every replica at once; each drains within
  --shutdown-timeout; what is left after that plus STOP_MARGIN_S (or at a second signal) is killed.
- SIGHUP is passed on to the replicas and the router, so each re-reads the --api-keys-file as a lone `pagoda serve`
  does (the router checks the keys too, and keys each tenant's prompts as the replicas' caches do).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from pagoda.core.machine import THREADS_ENV, threads_environ, threads_per_process
from pagoda.core.routing import POLICIES
from pagoda.router.settings import RouterSettings

logger = logging.getLogger("pagoda.data_parallel")

API_KEY_ENV = "PAGODA_API_KEY"  # as `pagoda serve` and `pagoda router` read it
DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
REPLICA_HOST = "127.0.0.1"  # replicas listen on loopback only; the router is what the user's --host exposes
STOP_MARGIN_S = 10.0  # past --shutdown-timeout: a process's exit after its drain (closing pools, the engine)
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the kernel to reap a child
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

SERVE_READY = re.compile(r"^pagoda serving (.*) at (http://\S+)")  # pagoda/cli/serve.py's ready line
ROUTER_READY = re.compile(r"^pagoda router at (http://\S+)")  # pagoda/cli/router.py's


@dataclass(frozen=True)
class DataParallelOptions:
    """`--data-parallel-size` and `--router-policy`: how many replicas, and how the router picks one."""

    size: int = 1
    router_policy: str = RouterSettings.policy

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.size}")
        if self.router_policy not in POLICIES:
            raise ValueError(f"unknown --router-policy {self.router_policy!r}; choose one of {', '.join(POLICIES)}")


def add_data_parallel_options(parser: argparse.ArgumentParser) -> None:
    """Add `--data-parallel-size` and `--router-policy` (dests data_parallel_size, router_policy) to serve."""
    g = parser.add_argument_group("data parallelism (docs/distributed.md, 'One command, N replicas')")
    g.add_argument("--data-parallel-size", type=int, default=DataParallelOptions.size, metavar="N",
                   help="engine processes, each a whole copy of the model, behind `pagoda router` on --host/--port "
                        "(default 1: this process serves)")
    g.add_argument("--router-policy", default=DataParallelOptions.router_policy, choices=POLICIES,
                   help="with --data-parallel-size > 1: how the router picks a replica")


def data_parallel_options(args: argparse.Namespace) -> DataParallelOptions:
    """The options the command line gives (ValueError when they are not valid)."""
    return DataParallelOptions(size=args.data_parallel_size, router_policy=args.router_policy)


def replica_command(command_line: Sequence[str]) -> list[str]:
    """A replica's `pagoda` arguments: the user's serve command line, one process, on a loopback port."""
    return [*command_line, "--data-parallel-size", "1", "--host", REPLICA_HOST, "--port", "0"]


def router_command(args: argparse.Namespace, replica_urls: Sequence[str], policy: str) -> list[str]:
    """The router's `pagoda` arguments: the replicas, the policy, and serve's host, port and shared options."""
    keys = ["--api-keys-file", args.api_keys_file] if args.api_keys_file is not None else []
    return ["router", *(a for url in replica_urls for a in ("--replica", url)), "--router-policy", policy,
            "--host", args.host, "--port", str(args.port), "--model", args.model, "--tool-parser", args.tool_parser,
            "--max-body-bytes", str(args.max_body_bytes), "--shutdown-timeout", str(args.shutdown_timeout),
            "--log-level", args.log_level, *keys]


def replica_devices(device: str, size: int, num_blocks: int | None, environ: Mapping[str, str]) -> list[str] | None:
    """Each replica's CUDA device (CUDA_VISIBLE_DEVICES), or None when they run on the CPU."""
    if device == "cpu":
        return None
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return None  # --device auto: the CPU; --device cuda: each replica says what is wrong
    visible = environ[DEVICES_ENV].split(",")[:count] if environ.get(DEVICES_ENV) else [str(i) for i in range(count)]
    if len(visible) < size and num_blocks is None:
        raise ValueError(f"{size} replicas on {len(visible)} CUDA device(s): each would size its KV cache from the "
                         f"same free memory; give --num-blocks, or at most --data-parallel-size {len(visible)}")
    return [visible[i % len(visible)] for i in range(size)]


def exit_status(child_status: int) -> int:
    """What the command exits with when a child failed: its status, or 1 for 0 or a signal (negative)."""
    return child_status if child_status > 0 else 1


def child_environ(environ: Mapping[str, str], threads: int | None, device: str | None,
                  api_key: str | None) -> dict[str, str]:
    """A child's environment: the user's, with its threads, its device and the key (kept off the command line)."""
    env = dict(environ)
    if threads is not None:
        env.update(threads_environ(threads, environ))
    if device is not None:
        env[DEVICES_ENV] = device
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return env


@dataclass(eq=False)
class Child:
    """One process the supervisor started: a replica or the router."""

    name: str  # "replica 0", "router": the tag on its output
    process: subprocess.Popen
    url: str | None = None  # from its ready line
    ready_line: str | None = None
    last_error: str = ""  # its last line on stderr, quoted when it fails
    watcher: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass(frozen=True)
class Ready:
    child: Child


@dataclass(frozen=True)
class Exited:
    child: Child
    status: int


@dataclass(frozen=True)
class Signalled:
    signum: int


@dataclass
class Supervisor:
    """The replicas and the router, and the one queue their events and the stop signals arrive on."""

    args: argparse.Namespace
    options: DataParallelOptions
    command_line: Sequence[str]
    api_key: str | None
    environ: Mapping[str, str]
    threads: int  # each replica's torch threads (pagoda/core/machine.py), unless the user set OMP_NUM_THREADS
    devices: list[str] | None  # each replica's CUDA device; None on the CPU
    children: list[Child] = field(default_factory=list)
    # SimpleQueue: its put() may run in a signal handler (it is reentrant), and its get() takes a timeout
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    output_lock: threading.Lock = field(default_factory=threading.Lock)

    def hang_up(self) -> None:
        """SIGHUP, passed on to every live child that is ready (its handler is installed by then; before, the signal
        would end it): the replicas and the router each re-read the --api-keys-file."""
        for child in list(self.children):
            if child.alive and child.ready_line is not None:
                child.process.send_signal(signal.SIGHUP)

    def run(self) -> int:
        """Start everything, print the ready line, serve until a signal or a failure, stop; the exit status."""
        try:
            status = self._start_and_serve()
        except BaseException:
            self._stop(1)  # no child outlives a bug here either
            raise
        return self._stop(status)

    def _start_and_serve(self) -> int:
        replicas = []
        for i in range(self.options.size):
            env = child_environ(self.environ, self.threads, None if self.devices is None else self.devices[i],
                                self.api_key)
            replicas.append(self._start(f"replica {i}", replica_command(self.command_line), env, SERVE_READY))
        logger.info("started %d replicas (pids %s), %s torch thread(s) each", len(replicas),
                    ", ".join(str(r.process.pid) for r in replicas), env[THREADS_ENV])
        status = self._until_ready(replicas)
        if status is not None:
            return status
        urls = [r.url for r in replicas]
        router = self._start("router", router_command(self.args, urls, self.options.router_policy),
                             child_environ(self.environ, None, None, self.api_key), ROUTER_READY)
        status = self._until_ready([router])
        if status is not None:
            return status
        name = SERVE_READY.match(replicas[0].ready_line).group(1)  # the served model's name, as serve prints it
        print(f"pagoda serving {name} at {router.url}", flush=True)
        return self._serve(replicas, router)

    def _start(self, name: str, pagoda_argv: list[str], env: dict[str, str], ready: re.Pattern) -> Child:
        cmd = [sys.executable, "-m", "pagoda.cli.data_parallel", str(os.getpid()), *pagoda_argv]
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace", process_group=0)
        child = Child(name, process)
        child.watcher = threading.Thread(target=self._watch, args=(child, ready), name=f"pagoda-dp-{name}",
                                         daemon=True)
        child.watcher.start()
        self.children.append(child)
        return child

    def _watch(self, child: Child, ready: re.Pattern) -> None:
        """Read a child's stdout for its ready line (the rest to stderr), then report its exit."""
        errors = threading.Thread(target=self._echo_stderr, args=(child,), daemon=True)
        errors.start()
        for line in child.process.stdout:  # ends when the child closes its stdout (it exits)
            match = ready.match(line) if child.url is None else None
            if match:
                child.url, child.ready_line = match.groups()[-1], line.strip()
                self.events.put(Ready(child))
            else:
                self._echo(child, line)
        status = child.process.wait()
        errors.join(timeout=KILL_WAIT_S)  # its last words on stderr come before the news of its exit
        self.events.put(Exited(child, status))

    def _echo_stderr(self, child: Child) -> None:
        for line in child.process.stderr:
            if line.strip():
                child.last_error = line.strip()
            self._echo(child, line)

    def _echo(self, child: Child, line: str) -> None:
        with self.output_lock:
            sys.stderr.write(f"[{child.name}] {line}")
            sys.stderr.flush()

    def _until_ready(self, children: list[Child]) -> int | None:
        """Wait until each of `children` printed its ready line (None), or a child exited or a stop signal
        came (the status to exit with)."""
        pending = set(children)
        while pending:  # each event is a child's first ready line, its exit, or a signal
            event = self.events.get()
            if isinstance(event, Signalled):
                logger.info("signal %d before the server was ready: stopping", event.signum)
                return 0
            if isinstance(event, Exited):
                said = f": {event.child.last_error}" if event.child.last_error else ""
                print(f"pagoda serve: {event.child.name} exited with status {event.status} before the server was "
                      f"ready{said}", file=sys.stderr, flush=True)
                return exit_status(event.status)
            pending.discard(event.child)
        return None

    def _serve(self, replicas: list[Child], router: Child) -> int:
        """Until a stop signal (0), the router's exit or the last replica's (1)."""
        live = set(replicas)
        while live:  # each event ends a child or the service
            event = self.events.get()
            if isinstance(event, Signalled):
                logger.info("signal %d: draining the router and %d replica(s)", event.signum, len(live))
                return 0
            if isinstance(event, Exited) and event.child is router:
                print(f"pagoda serve: the router exited with status {event.status}", file=sys.stderr, flush=True)
                return exit_status(event.status)
            if isinstance(event, Exited):
                live.discard(event.child)
                logger.error("%s (pid %d) exited with status %d; it is not restarted: the router routes around it, "
                             "%d of %d replicas serve", event.child.name, event.child.process.pid, event.status,
                             len(live), len(replicas))
        print("pagoda serve: every replica has exited", file=sys.stderr, flush=True)
        return 1

    def _stop(self, status: int) -> int:
        """SIGTERM to every child, wait for their drains, kill what is left; `status`, passed through."""
        for child in self.children:
            if child.alive:
                child.process.terminate()
        deadline = time.monotonic() + self.args.shutdown_timeout + STOP_MARGIN_S
        while any(c.alive for c in self.children) and (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)  # an exit, or a second signal
            except queue.Empty:
                break
            if isinstance(event, Signalled):
                logger.warning("signal %d while draining: killing what is left", event.signum)
                break
        for child in self.children:
            if child.alive:
                logger.warning("%s (pid %d) did not stop in time: killed", child.name, child.process.pid)
                child.process.kill()
        for child in self.children:
            try:
                child.process.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.error("%s (pid %d) outlived SIGKILL", child.name, child.process.pid)
            if child.watcher is not None:
                child.watcher.join(timeout=KILL_WAIT_S)  # its output, all of it, before ours ends
        return status


def run_data_parallel(args: argparse.Namespace, command_line: Sequence[str] | None, api_key: str | None) -> int:
    """`pagoda serve --data-parallel-size N`: the replicas and the router, supervised; the exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = data_parallel_options(args)
        if args.tensor_parallel_size != 1:
            raise ValueError("--data-parallel-size with --tensor-parallel-size > 1 is not supported: start each "
                             "tensor-parallel server yourself and put `pagoda router` in front of them")
        if command_line is None:
            raise ValueError("--data-parallel-size needs the command line its replicas repeat: run `pagoda serve`")
        environ = dict(os.environ)
        devices = replica_devices(args.device, options.size, args.num_blocks, environ)
        supervisor = Supervisor(args, options, command_line, api_key, environ, threads_per_process(options.size),
                                devices)
    except ValueError as exc:
        print(f"pagoda serve: {exc}", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, lambda signum, _frame: supervisor.events.put(Signalled(signum)))
                for s in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda _signum, _frame: supervisor.hang_up())
    try:
        return supervisor.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exec_as_child(parent_pid: int, pagoda_argv: list[str]) -> NoReturn:
    """The trampoline: die with the supervisor (Linux), then become `python -m pagoda ARGV`."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent_pid:  # the supervisor died before the signal was armed
            os._exit(1)
    os.execv(sys.executable, [sys.executable, "-m", "pagoda", *pagoda_argv])


if __name__ == "__main__":
    _exec_as_child(int(sys.argv[1]), sys.argv[2:])
