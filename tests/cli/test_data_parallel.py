"""`pagoda serve --data-parallel-size N`: N replicas of the default model behind the router, from one command.

One live command serves the whole module (each start loads the model twice): the official SDK through the
URL it prints, /health's two replicas, round robin over them, a replica's death routed around, and SIGTERM
ending every process it started. A command whose replicas cannot start fails on its own. The children are
found in /proc (Linux), as the command's children.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from pagoda.bench.serve.server import READY
from pagoda.cli.data_parallel import Supervisor, child_environ, replica_command, run_data_parallel
from pagoda.cli.main import build_parser, main
from pagoda.core import machine
from pagoda.core.machine import THREADS_ENV
from tests.helpers import reap, wait_for
from tests.router.helpers import REPLICA_HEADER

START_TIMEOUT_S = 300.0  # two model loads on a busy machine
SHUTDOWN_TIMEOUT_S = 5.0
BODY = {"model": "default", "prompt": "pagoda", "max_tokens": 2}


@dataclass
class Command:
    """The running `pagoda serve --data-parallel-size 2` and what it printed."""

    process: subprocess.Popen
    ready_line: str
    url: str
    log: Path  # its stderr

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=60).json()


def child_processes(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines (from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):  # it exited while we looked
            continue
    return found


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def first_line(process: subprocess.Popen, timeout: float) -> str:
    """The command's first line on stdout ("" when it closed stdout first), within `timeout`."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line, f"no line on stdout within {timeout:g} s"
    return line[0]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    log = tmp_path_factory.mktemp("data_parallel") / "stderr.log"
    cmd = [sys.executable, "-m", "pagoda", "serve", "--data-parallel-size", "2", "--router-policy", "round_robin",
           "--port", "0", "--num-blocks", "64", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--log-level", "warning"]
    with open(log, "w") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = first_line(process, START_TIMEOUT_S)
        match = READY.match(line)
        assert match, (line, process.poll(), log.read_text()[-3000:])
        yield Command(process, line.strip(), match.group(1), log)
    finally:
        reap(process, timeout=60)  # its children die with it (PR_SET_PDEATHSIG)


@pytest.mark.slow
def test_the_ready_line_is_serves_and_the_openai_sdk_chats_through_it(command):
    import openai

    assert command.ready_line.startswith("pagoda serving 'default' at http://127.0.0.1:"), command.ready_line
    client = openai.OpenAI(base_url=f"{command.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
    assert isinstance(reply.choices[0].message.content, str) and reply.usage.completion_tokens >= 1


@pytest.mark.slow
def test_health_shows_two_replicas_and_round_robin_spreads_concurrent_requests(command):
    health = command.health()
    assert health["status"] == "ok" and health["policy"] == "round_robin"
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"], health["replicas"]
    urls = [r["url"] for r in health["replicas"]]
    # read from the replicas themselves: the router's copy may be a poll older than the last test's requests
    before = [httpx.get(f"{url}/health", timeout=10).json()["requests_total"] for url in urls]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{command.url}/v1/completions", json=BODY, timeout=120),
                                range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    assert sorted(a.headers[REPLICA_HEADER] for a in answers) == sorted(urls)

    def counted_once_each() -> bool:  # the router's /health repeats each replica's latest poll
        return [r["requests_total"] - b for r, b in zip(command.health()["replicas"], before)] == [1, 1]

    wait_for(counted_once_each, "each replica's requests_total to count one request", timeout=30)


@pytest.mark.slow
def test_a_dead_replica_is_routed_around_and_sigterm_ends_everything_with_0(command):
    """The module's last test: it stops the command."""
    children = child_processes(command.process.pid)
    replicas = [pid for pid, cmdline in children.items() if " serve " in cmdline]
    assert len(replicas) == 2 and len(children) == 3, children  # two replicas and the router
    victim = replicas[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: f"(pid {victim}) exited" in command.log.read_text(), "the command to log the replica's death")
    wait_for(lambda: sorted(r["status"] for r in command.health()["replicas"]) != ["ok", "ok"],
             "the router to see the replica down")
    answer = httpx.post(f"{command.url}/v1/completions", json=BODY, timeout=120)
    assert answer.status_code == 200 and command.process.poll() is None  # the rest serves on

    command.process.send_signal(signal.SIGTERM)
    assert command.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 60) == 0, command.log.read_text()[-3000:]
    assert command.process.stdout.read() == ""  # nothing after the ready line
    wait_for(lambda: all(gone(pid) for pid in children), f"the command's children {sorted(children)} to be gone",
             timeout=10)


@pytest.mark.slow
def test_sighup_reaches_every_replica_so_each_rereads_the_keys_file(tmp_path):
    keys = tmp_path / "keys.json"

    def write_keys(*names: str) -> None:
        keys.write_text(json.dumps({"tenants": [{"name": n, "key_sha256": hashlib.sha256(f"key-{n}".encode())
                                                 .hexdigest()} for n in names]}))

    write_keys("a")
    cmd = [sys.executable, "-m", "pagoda", "serve", "--data-parallel-size", "2", "--router-policy", "round_robin",
           "--port", "0", "--num-blocks", "64", "--api-keys-file", str(keys), "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = READY.match(first_line(process, START_TIMEOUT_S)).group(1)

        def statuses(key: str) -> dict[str, int]:  # round robin: two requests, one on each replica
            answers = [httpx.post(f"{url}/v1/completions", json=BODY, timeout=120,
                                  headers={"Authorization": f"Bearer {key}"}) for _ in range(2)]
            return {a.headers.get(REPLICA_HEADER, "router"): a.status_code for a in answers}

        assert set(statuses("key-a").values()) == {200} and set(statuses("key-b").values()) == {401}
        write_keys("a", "b")
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: list(statuses("key-b").values()) == [200, 200], "both replicas to take the new key")
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        reap(process, timeout=60)


@pytest.mark.slow
def test_a_replica_that_cannot_start_fails_the_command_and_leaves_no_process():
    marker = f"dp-{uuid.uuid4().hex}"  # names the command's processes in /proc
    cmd = [sys.executable, "-m", "pagoda", "serve", "--data-parallel-size", "2", "--model", "/nonexistent",
           "--port", "0", "--served-model-name", marker]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "pagoda serving" not in done.stdout, (done.returncode, done.stdout)
    assert "/nonexistent" in done.stderr and "before the server was ready" in done.stderr, done.stderr
    assert "[replica " in done.stderr, done.stderr  # the replica's own error, tagged with it
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in _read(p)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize(("argv", "said"), [
    (["--data-parallel-size", "0"], "at least 1"),
    (["--data-parallel-size", "2", "--tensor-parallel-size", "2"], "--tensor-parallel-size"),
])
def test_what_cannot_run_is_refused_with_status_2(capsys, argv, said):
    assert main(["serve", *argv]) == 2
    assert said in capsys.readouterr().err


def test_a_replica_repeats_the_command_line_on_loopback_with_its_share_of_threads():
    # no --port: serve's default (a fixed one) must become 0, the kernel's pick; nothing here binds a socket
    user = ["serve", "--host", "localhost", "--data-parallel-size", "2", "--router-policy", "least_load",
            "--max-running", "7"]
    assert build_parser().parse_args(user).port != 0
    args = build_parser().parse_args(replica_command(user))
    assert (args.host, args.port, args.data_parallel_size, args.max_running) == ("127.0.0.1", 0, 1, 7)
    assert child_environ({}, 3, None, None)[THREADS_ENV] == "3"
    assert child_environ({THREADS_ENV: "5"}, 3, None, None)[THREADS_ENV] == "5"  # the user's count wins
    assert child_environ({}, 3, "1", "k") == {THREADS_ENV: "3", "CUDA_VISIBLE_DEVICES": "1", "PAGODA_API_KEY": "k"}


REPLICA_THREADS = """
from pagoda.core import machine
machine.prepare_process()  # what `pagoda` does first
print(machine.configure_threads())  # and what assembling the replica's engine does (pagoda/model/factory.py)
"""


def test_a_replica_runs_on_the_threads_machine_decides_for_it(monkeypatch):
    """The supervisor's share for each replica is machine.py's, and torch runs on it inside a replica started with
    the environment the supervisor gives it (torch's own there would be one per physical core)."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    started = []
    monkeypatch.setattr(Supervisor, "run", lambda self: started.append(self) or 0)
    argv = ["serve", "--data-parallel-size", "2", "--device", "cpu"]
    threads = torch.get_num_threads()
    machine.set_threads(machine.cpu_facts().cores)  # a supervisor's count; torch takes no more from the variable
    try:
        assert run_data_parallel(build_parser().parse_args(argv), argv, None) == 0
        decided = machine.threads_per_process(2)
    finally:
        machine.set_threads(threads)
    [supervisor] = started
    assert supervisor.threads == decided
    env = child_environ(supervisor.environ, supervisor.threads, None, None)
    replica = subprocess.run([sys.executable, "-c", REPLICA_THREADS], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
    assert int(replica.stdout.split()[-1]) == decided
