"""A pagoda server for `pagoda bench serve` to load: `python -m pagoda serve --port 0` in a child process.

A separate process, so the benchmark's client does not share the server's
interpreter (and its GIL). The URL is read from the line `pagoda serve`
prints when it listens; its log goes to a file, whose tail explains a server
that exits before it is ready.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

READY = re.compile(r"pagoda serving .* at (http://\S+)")
ROUTER_READY = re.compile(r"pagoda router at (http://\S+)")  # `pagoda router`'s first line


def serve_command(model: str, *, dtype: str | None = None, quantization: str | None = None, num_blocks: int | None = None,
                  max_running: int | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The `pagoda serve` command line; `extra` (--server-arg) comes last, so it overrides."""
    cmd = [sys.executable, "-m", "pagoda", "serve", "--host", "127.0.0.1", "--port", "0", "--model", model,
           "--log-level", "warning"]  # no access log line per request in the numbers
    for flag, value in (("--dtype", dtype), ("--quantization", quantization), ("--num-blocks", num_blocks),
                        ("--max-running", max_running)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(extra)


@contextmanager
def pagoda_subprocess(cmd: list[str], ready_timeout: float, *, env: Mapping[str, str] | None = None,
                      ready: re.Pattern[str] = READY) -> Iterator[str]:
    """Run `cmd` (in `env`, default this process's), yield the URL it prints once ready (the first group of
    `ready`); the child is stopped on the way out."""
    log = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                             env=None if env is None else dict(env))
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:  # keeps reading to EOF, so the child never blocks on a full stdout pipe
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    try:
        yield _wait_ready(child, lines, log, ready_timeout, ready)
    finally:
        stop_child(child, log)


def stop_child(child: subprocess.Popen, log) -> None:
    """Stop a server child (terminate, then kill if it lingers) and close its log."""
    child.terminate()
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(timeout=15)
    log.close()


def _wait_ready(child: subprocess.Popen, lines: queue.Queue, log, timeout: float, ready: re.Pattern[str] = READY) -> str:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            child.wait(timeout=15)
            raise RuntimeError(f"pagoda serve exited ({child.returncode}) before it was ready:\n{_tail(log)}")
        if m := ready.search(line):
            return m.group(1)
    raise RuntimeError(f"pagoda serve was not ready within {timeout:g} s:\n{_tail(log)}")


def _tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]
