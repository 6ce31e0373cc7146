"""`pagoda router`: every option reaches RouterSettings, bad ones are refused, and the command serves."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import httpx
import pytest

from pagoda.cli.main import build_parser, main
from pagoda.cli.router import router_settings
from pagoda.model.hub import resolve_model
from pagoda.router.settings import RouterSettings
from tests.helpers import reap, wait_for
from tests.router.helpers import REPLICA_HEADER, replicas  # noqa: F401  (fixtures)

BASE = ["--replica", "http://127.0.0.1:8001"]

# option -> (its arguments, what must hold of the settings they built)
ROWS: dict[str, tuple[list[str], Callable[[RouterSettings], Any]]] = {
    "--replica": (["--replica", "http://a:1/", "--replica", "https://b:2"],
                  lambda s: s.replicas == ("http://a:1", "https://b:2")),
    "--router-policy": (["--router-policy", "power_of_two"], lambda s: s.policy == "power_of_two"),
    "--policy": (["--policy", "least_load"], lambda s: s.policy == "least_load"),  # the old name, for one release
    "--host": (["--host", "::1"], lambda s: s.host == "::1"),
    "--port": (["--port", "0"], lambda s: s.port == 0),
    "--api-key": (["--api-key", "sekret"], lambda s: s.api_key == "sekret"),
    "--api-keys-file": (["--api-keys-file", "keys.toml"], lambda s: s.api_keys_file == "keys.toml"),
    "--max-queue-per-replica": (["--max-queue-per-replica", "3"], lambda s: s.max_queue_per_replica == 3),
    "--health-interval": (["--health-interval", "0.25"], lambda s: s.health_interval == 0.25),
    "--health-timeout": (["--health-timeout", "1.5"], lambda s: s.health_timeout == 1.5),
    "--seed": (["--seed", "9"], lambda s: s.seed == 9),
    "--max-body-bytes": (["--max-body-bytes", "1000"], lambda s: s.max_body_bytes == 1000),
    "--shutdown-timeout": (["--shutdown-timeout", "7"], lambda s: s.shutdown_timeout == 7),
    "--log-level": (["--log-level", "warning"], lambda s: s.log_level == "warning"),
    "--model": (["--model", str(resolve_model("default", progress=False))],
                lambda s: s.model_dir == str(resolve_model("default", progress=False))),
    "--tool-parser": (["--tool-parser", "none"], lambda s: s.tool_parser is None),
    "--balance-abs-threshold": (["--balance-abs-threshold", "3"], lambda s: s.balance_abs_threshold == 3),
    "--balance-rel-threshold": (["--balance-rel-threshold", "2.5"], lambda s: s.balance_rel_threshold == 2.5),
    "--cache-threshold": (["--cache-threshold", "0.6"], lambda s: s.cache_threshold == 0.6),
}


def settings_of(argv: list[str], environ: dict[str, str] | None = None) -> RouterSettings:
    return router_settings(build_parser().parse_args(["router", *argv]), environ or {})


@pytest.mark.parametrize("option", sorted(ROWS))
def test_each_option_reaches_the_settings(option):
    argv, holds = ROWS[option]
    assert holds(settings_of(argv if option == "--replica" else [*BASE, *argv]))


def test_every_option_has_a_row_and_the_defaults_are_the_contracts():
    parser = build_parser()
    router = parser._subparsers._group_actions[0].choices["router"]
    options = {o for a in router._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert options == set(ROWS)
    s = settings_of(BASE)
    assert (s.policy, s.host, s.port, s.api_key) == ("prefix", "127.0.0.1", 8000, None)
    assert s.model_dir == str(resolve_model("default", progress=False)) and s.tool_parser == "hermes"
    assert settings_of(BASE, {"PAGODA_API_KEY": "from-env"}).api_key == "from-env"


def test_the_old_policy_flag_still_works_and_says_once_to_use_router_policy(capsys):
    assert settings_of([*BASE, "--policy", "round_robin"]).policy == "round_robin"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--policy is deprecated" in err[0] and "--router-policy" in err[0]
    assert settings_of([*BASE, "--router-policy", "round_robin"]).policy == "round_robin"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["--replica", "127.0.0.1:8001"], "not an http"),
    (["--replica", "http://a:1", "--replica", "http://a:1/"], "named twice"),
    ([*BASE, "--max-queue-per-replica", "0"], "max_queue_per_replica"),
    ([*BASE, "--health-interval", "0"], "health_interval"),
    ([*BASE, "--model", "/no/such/model"], "is not 'default'"),
    ([*BASE, "--balance-rel-threshold", "0.5"], "balance thresholds"),
    ([*BASE, "--api-keys-file", "/no/such/keys.json"], "cannot read it"),
])
def test_bad_settings_are_refused_with_status_2(capsys, argv, message):
    assert main(["router", *argv]) == 2
    assert message in capsys.readouterr().err


@contextmanager
def router_command(replicas, *extra: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pagoda router` (round robin) over `replicas` in a child process; yields it and the URL it printed."""
    cmd = [sys.executable, "-m", "pagoda", "router", "--port", "0", "--router-policy", "round_robin", "--log-level",
           "warning",
           *extra, *(arg for r in replicas for arg in ("--replica", r.url))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        assert line and line[0].startswith("pagoda router at http://127.0.0.1:"), (line, proc.poll())
        yield proc, line[0].split(" at ")[1].strip()
    finally:
        reap(proc)


def test_the_command_prints_its_url_serves_and_exits_0_on_sigterm(replicas):  # noqa: F811
    with router_command(replicas) as (proc, url):
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["status"] == "ok" and [r["url"] for r in health["replicas"]] == [r.url for r in replicas]
        body = {"model": "m", "prompt": "pagoda", "max_tokens": 2}
        served = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).headers[REPLICA_HEADER] for _ in range(2)]
        assert served == [r.url for r in replicas]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_sigterm_drains_new_requests_get_503_and_the_stream_in_flight_ends_whole(replicas):  # noqa: F811
    """The first SIGTERM: /health and every new request answer 503 ("draining", with Retry-After), the stream
    in flight runs to its end, then the command exits 0."""
    with router_command(replicas, "--shutdown-timeout", "60") as (proc, url):
        body = {"model": "m", "prompt": "pagoda", "max_tokens": 900, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
            events = stream.iter_lines()
            assert next(e for e in events if e.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, "the router to drain")
            health = httpx.get(f"{url}/health", timeout=30).json()
            assert health["status"] == "draining" and health["in_flight"] == 1
            refused = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                                 timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.json()["error"]["code"] == "draining" and REPLICA_HEADER not in refused.headers
            rest = [e for e in events if e.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and len(rest) > 10
        assert proc.wait(timeout=60) == 0
