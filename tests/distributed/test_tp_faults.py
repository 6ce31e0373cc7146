"""A lost rank is a bounded, clean failure of a real `pagoda serve --tensor-parallel-size 2`, never a hang.

Killed mid-stream, stopped (a hung rank: its collective times out), or killed while the server is idle:
the stream in flight ends with the protocol's error event, /health says 503 and why, new requests get a
503, and within a bound every rank has exited, the server with status 1 (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.bench.serve.server import READY
from pagoda.cli.serve import FAILED_GROUP_LINGER_S

pytestmark = pytest.mark.slow

BOUND_S = 30.0  # from the fault to the stream's end, and again to every rank's exit
TIMEOUT_S = 3  # --distributed-timeout: how long a collective waits for a hung rank


class Served:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        cmd = [sys.executable, "-m", "pagoda", "serve", "--model", str(model_dir), "--port", "0", "--dtype", "float32",
               "--num-blocks", "64", "--tensor-parallel-size", "2", "--distributed-timeout", str(TIMEOUT_S),
               "--served-model-name", "m", "--log-level", "warning"]
        self.log = open(log_path, "w+")
        self.child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, text=True)
        for line in self.child.stdout:  # ends if the child exits before it is ready
            if match := READY.search(line):
                self.url = match.group(1)
                break
        else:
            raise AssertionError(f"the server exited before it was ready: {self.said()}")
        self.pids = httpx.get(self.url + "/health", timeout=30).json()["tensor_parallel"]["pids"]
        assert self.pids[0] == self.child.pid and len(self.pids) == 2

    def said(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.kill()
            self.child.wait(30)
        for pid in self.pids[1:]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    s = Served(tiny_model_dir, tmp_path / "serve.log")
    try:
        yield s
    finally:
        s.close()


def stream_until_fault(served: Served, fault) -> tuple[list[dict], float]:
    """Stream a long chat answer, apply `fault` five chunks in; the chunks after it and the seconds they took."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    after, started = [], None
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=BOUND_S) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if started is not None:
                after.append(json.loads(line[6:]))
            seen += 1
            if seen == 5:
                fault()
                started = time.monotonic()
    return after, time.monotonic() - started


def check_failed_cleanly(served: Served) -> None:
    """/health and a new request say 503 with the reason; then every rank exits, the server with status 1."""
    health = httpx.get(served.url + "/health", timeout=BOUND_S)
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "unavailable" and "tensor-parallel" in health.json()["error"], health.json()
    refused = httpx.post(served.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                         timeout=BOUND_S)
    assert refused.status_code == 503, refused.text
    assert served.child.wait(BOUND_S + FAILED_GROUP_LINGER_S) == 1, served.said()
    deadline = time.monotonic() + BOUND_S
    while any(alive(pid) for pid in served.pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)  # a rank's exit has no event to wait on from here: polled, bounded
    assert not any(alive(pid) for pid in served.pids), served.said()
    assert "tensor-parallel" in served.said()


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_every_rank_exits(served):
    after, seconds = stream_until_fault(served, lambda: os.kill(served.pids[1], signal.SIGKILL))
    assert seconds < BOUND_S
    assert "error" in after[-1], after[-3:]  # the stream's last event is its error, not a silent cut
    check_failed_cleanly(served)


def test_a_hung_worker_times_the_collective_out_and_every_rank_exits(served):
    after, seconds = stream_until_fault(served, lambda: os.kill(served.pids[1], signal.SIGSTOP))
    assert TIMEOUT_S * 0.5 < seconds < BOUND_S  # it waited for the timeout, and not much longer
    assert "error" in after[-1], after[-3:]
    check_failed_cleanly(served)


def test_a_worker_lost_while_idle_is_noticed_before_the_next_request(served):
    os.kill(served.pids[1], signal.SIGKILL)
    deadline = time.monotonic() + BOUND_S
    while httpx.get(served.url + "/health", timeout=BOUND_S).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)  # polled, bounded: the watcher thread notices the exit at once
    check_failed_cleanly(served)


def test_an_idle_server_outlives_the_collective_timeout(served):
    # Idle for twice --distributed-timeout: a duration is the condition here. The workers wait for the next plan
    # on the control group, which has no deadline; only a collective inside a step has one.
    time.sleep(2 * TIMEOUT_S)
    r = httpx.post(served.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}, timeout=BOUND_S)
    assert r.status_code == 200, r.text
    assert httpx.get(served.url + "/health", timeout=BOUND_S).json()["status"] == "ok"
