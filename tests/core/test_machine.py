"""The process's CPU set-up: one place (for the server, a rank and a replica), before torch loads, and nothing left
in a child's environment."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagoda.core import machine

PROBE = """
import json, os, sys
from pagoda.core import machine
before = "torch" in sys.modules
state = machine.prepare_process()
import torch
print(json.dumps({"torch_before": before, "policy": state.wait_policy, "env": os.environ.get("OMP_WAIT_POLICY"),
                  "threads": machine.configure_threads(1), "torch_threads": torch.get_num_threads()}))
"""


def probe(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_loads_with_sleeping_openmp_threads_and_the_environment_is_left_as_it_was():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    seen = probe(env)
    assert seen["torch_before"] is False  # importing the module loads no torch
    assert seen["policy"] == "PASSIVE"  # what libgomp read when torch loaded
    assert seen["env"] is None  # a child started now inherits the user's environment, not pagoda's
    assert seen["threads"] == seen["torch_threads"] == 1


def test_a_policy_the_user_set_wins_and_stays():
    seen = probe({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"})
    assert seen["policy"] == "ACTIVE" and seen["env"] == "ACTIVE"


# --- every decision about the CPU set-up is machine.py's: read from the source -------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "pagoda"
MACHINE = PACKAGE / "core" / "machine.py"
SETTERS = {"set_num_threads", "set_num_interop_threads"}  # torch's
VARIABLES = {"OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_PROC_BIND"}  # OpenMP's
VARIABLE_NAMES = {"THREADS_ENV", "WAIT_POLICY_ENV"}  # machine.py's names for them
COUNTS = {"get_num_threads", "cpu_count", "sched_getaffinity"}  # what a division of the machine starts from


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return None


def _read_names(tree: ast.AST) -> set[int]:
    """The ids of the nodes naming a variable (a string, or machine.py's name for one) that `tree` only reads:
    environ.get(X), getenv(X), X in environ, environ[X] (a benchmark prints the policy it ran under)."""
    read = set()
    for node in ast.walk(tree):
        if _called(node) in ("get", "getenv") and node.args:
            read.add(id(node.args[0]))
        elif isinstance(node, ast.Compare) and all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            read.add(id(node.left))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            read.add(id(node.slice))
    return read


def cpu_decisions(source: str) -> list[tuple[int, str]]:
    """Where `source` decides the CPU set-up itself, as (line, what): a torch thread setter named (called, imported
    or passed on), an OpenMP variable named (as a string, or by machine.py's name for it) other than to read it, or
    a thread or core count divided."""
    found = []
    tree = ast.parse(source)
    read = _read_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SETTERS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in SETTERS:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom) and any(alias.name in SETTERS for alias in node.names):
            found.append((node.lineno, "import of a thread setter"))
        elif isinstance(node, ast.Constant) and node.value in VARIABLES and id(node) not in read:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg in VARIABLES:  # env.update(OMP_NUM_THREADS=...)
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.Name) and node.id in VARIABLE_NAMES and id(node) not in read:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Div)) and any(
                _called(inner) in COUNTS for side in (node.left, node.right) for inner in ast.walk(side)):
            found.append((node.lineno, "a thread count divided"))
    return sorted(found)


def test_no_module_but_machine_decides_the_cpu_set_up():
    """The runner's switches inside a step, the ranks' and the replicas' shares, all go through machine.py."""
    found = {str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py")) if path != MACHINE
             if (hits := cpu_decisions(path.read_text()))}
    assert found == {}


def test_the_source_check_finds_machines_own_decisions_and_each_planted_form():
    """Not vacuous: it sees the real setter, variables and division in machine.py, and every way of writing one."""
    in_machine = {what for _, what in cpu_decisions(MACHINE.read_text())}
    assert {"set_num_threads", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "a thread count divided"} <= in_machine
    planted = ["torch.set_num_threads(2)", "from torch import set_num_threads", "set = torch.set_num_interop_threads",
               "os.environ['OMP_NUM_THREADS'] = '1'", "env = {**os.environ, 'OMP_WAIT_POLICY': 'PASSIVE'}",
               "os.environ.setdefault('GOMP_SPINCOUNT', '0')", "env.update(OMP_NUM_THREADS='2')",
               "os.environ[WAIT_POLICY_ENV] = given or PASSIVE", "del os.environ[WAIT_POLICY_ENV]",
               "env = {THREADS_ENV: str(threads)}",
               "threads = max(1, torch.get_num_threads() // size)", "share = len(os.sched_getaffinity(0)) / 2",
               "n = os.cpu_count() // replicas"]
    assert [source for source in planted if not cpu_decisions(source)] == []
    quiet = ['"""Each replica gets OMP_NUM_THREADS=1."""', "n = torch.get_num_threads()",
             "configure_threads(threads_per_process(size))", "half = size // 2",
             "print(os.environ.get('GOMP_SPINCOUNT', '-'))", "user_set = 'OMP_NUM_THREADS' in os.environ",
             "given = os.environ.get(WAIT_POLICY_ENV)", "print(env[THREADS_ENV])"]
    assert [source for source in quiet if cpu_decisions(source)] == []


# --- the environment, set for a moment and put back ----------------------------------------------------------------

def test_environ_defaults_sets_what_is_unset_for_the_scope_and_puts_everything_back():
    environ = {"KEPT": "user", "EMPTY": ""}
    with machine.environ_defaults({"KEPT": "ours", "EMPTY": "ours", "NEW": "ours"}, environ):
        assert environ == {"KEPT": "user", "EMPTY": "ours", "NEW": "ours"}  # the user's value wins; empty is unset
    assert environ == {"KEPT": "user", "EMPTY": ""}
    with pytest.raises(RuntimeError), machine.environ_defaults({"NEW": "ours"}, environ):
        raise RuntimeError("failed inside")
    assert environ == {"KEPT": "user", "EMPTY": ""}  # put back on the way out of a failure too


def test_children_are_started_waiting_passive_and_the_policy_is_gone_after(monkeypatch):
    monkeypatch.delenv(machine.WAIT_POLICY_ENV, raising=False)
    with machine.children_wait_passive():
        assert os.environ[machine.WAIT_POLICY_ENV] == machine.PASSIVE
    assert machine.WAIT_POLICY_ENV not in os.environ
    monkeypatch.setenv(machine.WAIT_POLICY_ENV, "ACTIVE")
    with machine.children_wait_passive():
        assert os.environ[machine.WAIT_POLICY_ENV] == "ACTIVE"
    assert os.environ[machine.WAIT_POLICY_ENV] == "ACTIVE"


# --- the thread counts: a share of the machine, and how a child is given one ---------------------------------------

@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    machine.set_threads(4)
    yield
    machine.set_threads(before)


def test_a_process_of_n_gets_an_even_share_and_never_none(four_threads):
    assert [machine.threads_per_process(n) for n in (1, 2, 3, 4, 5, 64)] == [4, 2, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="at least 1"):
        machine.threads_per_process(0)


def test_a_child_is_started_on_its_threads_unless_the_user_named_a_count():
    assert machine.threads_environ(3) == {"OMP_NUM_THREADS": "3"}
    assert machine.threads_environ(3, {}) == {"OMP_NUM_THREADS": "3"}
    assert machine.threads_environ(3, {"OMP_NUM_THREADS": "5"}) == {}  # the user's count wins
    assert machine.threads_environ(3, {"OMP_NUM_THREADS": ""}) == {"OMP_NUM_THREADS": "3"}  # empty names none


def test_set_threads_and_configure_threads_set_torchs_count(four_threads):
    machine.set_threads(1)
    assert torch.get_num_threads() == 1
    assert machine.configure_threads(3) == torch.get_num_threads() == 3
    assert machine.configure_threads() == 3  # None: the count as it is
    with pytest.raises(ValueError, match="at least 1"):
        machine.configure_threads(0)
