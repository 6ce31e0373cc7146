"""A peer server for `pagoda bench serve` to start: `--peer-command` run as a child, ready once `/health` answers 200.

The command is any server's own command line (llama.cpp's `llama-server -m MODEL.gguf --port N ...`, vLLM's
`vllm serve ...`); `--peer-url` says where it will listen. Its output goes to a file, whose tail explains a
peer that exits before it is ready. The child is stopped on the way out.
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from pagoda.bench.serve.server import stop_child


@contextmanager
def peer_process(command: str, url: str, ready_timeout: float, poll_s: float = 0.25) -> Iterator[str]:
    """Run `command`, wait until `url`/health answers 200, yield `url`; the child is stopped on the way out."""
    log = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_healthy(child, url.rstrip("/"), log, ready_timeout, poll_s)
        yield url
    finally:
        stop_child(child, log)


def _wait_healthy(child: subprocess.Popen, url: str, log, timeout: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise RuntimeError(f"the peer command exited ({child.returncode}) before it was ready:\n{_tail(log)}")
            try:
                if http.get(f"{url}/health").status_code == 200:  # llama-server answers 503 while it loads
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(poll_s)  # a poll interval: nothing to observe but the socket itself
    raise RuntimeError(f"the peer was not healthy at {url}/health within {timeout:g} s:\n{_tail(log)}")


def _tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]
