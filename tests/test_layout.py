"""The rooms' dependencies point one way, read from the source (docs/architecture.md draws them).

Every `import pagoda.x` / `from pagoda.x import` in a module, including the ones inside functions and under
`if TYPE_CHECKING:`, is a dependency of its room, and so is a string that names a pagoda module (what
`importlib.import_module` loads: the built-in plugins' table). A room may import itself and the rooms listed for
it, nothing else; inside a room the modules' imports form no cycle; a built-in plugin imports no other built-in
plugin; the modules that must load anywhere (the bookkeeping, the plugin interface) may not import torch or
xgrammar at all, and the router and what it shares with the server import no engine. The last test starts
`pagoda router` itself and fails at its first import of torch or xgrammar.
"""

from __future__ import annotations

import ast
import os
import select
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.plugins.manager import BUILTIN_ARCHITECTURES, BUILTIN_PLUGINS
from tests.helpers import reap

PACKAGE = Path(__file__).resolve().parents[1] / "pagoda"

# room -> the other rooms it may import
ALLOWED = {
    "kernels": set(),
    "core": set(),
    "distributed": {"core"},
    "model": {"core", "distributed", "kernels", "plugins"},  # plugins: the architecture hook its families implement
    "simulator": {"core"},
    "plugins": {"core"},
    "api": {"core", "plugins"},
    "router": {"api", "core", "plugins"},  # a reverse proxy in front of replicas: pagoda's HTTP pieces, no engine
    "harness": {"api", "core", "model", "plugins", "router", "simulator"},
    "bench": {"api", "core", "distributed", "harness", "kernels", "model", "plugins", "router", "simulator"},
    "cli": {"api", "bench", "core", "harness", "model", "plugins", "router", "simulator"},
}
HEAVY = ("torch", "xgrammar")  # what a module that must load anywhere may not import, even through pagoda's
# Modules that must import without them: the simulator drives the first, any plugin loads the second.
TORCH_FREE = ["core/request.py", "core/block_manager.py", "core/block_hash.py", "core/scheduler.py",
              "core/batch.py", "core/engine_config.py", "core/scheduling.py", "core/outputs.py", "core/sampling_params.py",
              "core/constraint.py", "core/routing.py", "plugins/protocol.py", "plugins/request_fields.py",
              "plugins/hookspecs.py", "plugins/manager.py", "plugins/client.py", "plugins/route.py",
              "plugins/disconnect.py", "plugins/tools.py", "plugins/tool_stream.py", "plugins/tool_render.py",
              "plugins/error_shapes.py", "plugins/choices.py", "plugins/architecture.py", "plugins/turn.py"]
# The router (a process that forwards bytes) and the modules it shares with the server: no engine behind them.
ENGINE = ("pagoda.core.engine", "pagoda.core.async_engine")
NO_ENGINE = ["api/http_errors.py", "api/body.py", "api/tenants.py", "api/stream_writer.py", "api/server.py",
             *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "router").glob("*.py"))]
# Every built-in plugin, by name: the plugin interface's own and the model room's families.
BUILTINS = {**BUILTIN_PLUGINS, **{name: f"pagoda.model.families.{name}" for name in BUILTIN_ARCHITECTURES}}


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module name a file imports, at any depth (function-level and type-checking imports included).

    `from pagoda.x import y` names the module pagoda.x.y when y is a module of `package`, else pagoda.x. A string
    that is exactly the name of one of the package's modules (not a package: logger names are) is imported too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("pagoda."):
            found = module_path(node.value, package)
            if found is not None and found.name != "__init__.py":
                names.add(node.value)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if module_path(sub, package) is not None:
                    names.add(sub)
    return names


def module_path(module: str, package: Path = PACKAGE) -> Path | None:
    """The file of a pagoda module (a package's __init__.py), or None when it is not one of ours."""
    parts = module.split(".")
    if parts[0] != "pagoda":
        return None
    base = package.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(("pagoda", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_cycles(package: Path = PACKAGE) -> list[list[str]]:
    """The import cycles among the modules of one room (each as the modules around it), none when it is acyclic."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.parent == package:
            continue
        name = module_name(path, package)
        room = name.split(".")[1]
        graph[name] = {m for m in imported_modules(path, package)
                       if m != name and room_of(m) == room and module_path(m, package) is not None}
    cycles, done, on_path = [], set(), []

    def visit(node: str) -> None:  # depth first; a back edge onto the current path closes a cycle
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                cycles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        on_path.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return cycles


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pagoda" else None


ROOM_FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def test_every_room_is_listed():
    assert {p.relative_to(PACKAGE).parts[0] for p in ROOM_FILES} == set(ALLOWED)


@pytest.mark.parametrize("path", ROOM_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_backwards(path):
    room = path.relative_to(PACKAGE).parts[0]
    backwards = sorted(m for m in imported_modules(path)
                       if room_of(m) not in (None, room) and room_of(m) not in ALLOWED[room])
    assert not backwards, f"{room}/ may not import {backwards}"


def reachable(path: Path) -> dict[str, Path]:
    """Every module `path` imports, directly or through the pagoda modules it imports -> the file importing it."""
    found: dict[str, Path] = {}
    seen, todo = set(), [path]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in imported_modules(path):
            found.setdefault(module, path)
            if (target := module_path(module)) is not None:
                todo.append(target)
    return found


@pytest.mark.parametrize("name", TORCH_FREE + NO_ENGINE)
def test_the_bookkeeping_the_plugin_interface_and_the_router_import_no_torch(name):
    """Not directly, and not through the pagoda modules they import (the built-in plugins' table included)."""
    heavy = {m: by for m, by in reachable(PACKAGE / name).items() if m.partition(".")[0] in HEAVY}
    assert not heavy, f"{name} imports {sorted(heavy)} ({', '.join(sorted({str(p) for p in heavy.values()}))})"


@pytest.mark.parametrize("name", NO_ENGINE)
def test_the_router_and_what_it_shares_with_the_server_import_no_engine(name):
    engine = {m: by for m, by in reachable(PACKAGE / name).items()
              if m in ENGINE or room_of(m) == "model"}
    assert not engine, f"{name} imports {sorted(engine)} ({', '.join(sorted({str(p) for p in engine.values()}))})"


def test_no_room_has_an_import_cycle():
    assert import_cycles() == []


def test_a_planted_cycle_is_caught(tmp_path):
    """A copy of the tree with one type-checking import that closes a circle (manager -> protocol -> manager)."""
    copy = tmp_path / "pagoda"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    protocol = copy / "plugins" / "protocol.py"
    text = protocol.read_text().replace("if TYPE_CHECKING:\n",
                                        "if TYPE_CHECKING:\n    from pagoda.plugins.manager import PluginInfo\n", 1)
    assert text != protocol.read_text()
    protocol.write_text(text)
    cycles = import_cycles(copy)
    assert any({"pagoda.plugins.protocol", "pagoda.plugins.manager"} <= set(c) for c in cycles), cycles


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_a_builtin_plugin_imports_no_other_builtin_plugin(name):
    """So each can be left out alone: what two built-ins share belongs in the plugin interface."""
    others = {module for other, module in BUILTINS.items() if other != name}
    path = module_path(BUILTINS[name])
    assert path is not None, f"{name}: no module {BUILTINS[name]}"
    assert not imported_modules(path) & others, f"{name} imports {sorted(imported_modules(path) & others)}"


def test_the_model_room_registers_the_families_the_manager_names():
    """The manager names the families (so any process can leave one out); the model room imports exactly those."""
    families = {m for m in imported_modules(PACKAGE / "model" / "families" / "__init__.py")
                if m.startswith("pagoda.model.families.")}
    assert families == {BUILTINS[name] for name in BUILTIN_ARCHITECTURES}


# `pagoda router`, ended at its first import of torch or xgrammar, with the stack that asked for it
REFUSE_HEAVY = f"""
import os, sys, traceback
def refuse(event, args):
    if event == "import" and args[0].partition(".")[0] in {HEAVY!r}:
        sys.stderr.write("pagoda router imported " + args[0] + ":\\n" + "".join(traceback.format_stack()))
        sys.stderr.flush()
        os._exit(3)
sys.addaudithook(refuse)
from pagoda.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_router_starts_without_torch(default_model_dir):
    """A process that forwards bytes loads no engine: `pagoda router` (its default policy, prefix, reads prompts
    with the model's tokenizer) prints its URL without importing torch or xgrammar. Installed plugins are left out
    (PAGODA_PLUGINS=none): a third-party architecture plugin imports torch itself."""
    with socket.socket() as unused:  # a loopback port no one listens on: the replica is down, the router starts
        unused.bind(("127.0.0.1", 0))
        replica = f"http://127.0.0.1:{unused.getsockname()[1]}"
        router = subprocess.Popen(
            [sys.executable, "-c", REFUSE_HEAVY, "router", "--replica", replica, "--port", "0",
             "--model", str(default_model_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PAGODA_PLUGINS": "none"})
        try:
            ready, _, _ = select.select([router.stdout], [], [], 120)
            line = router.stdout.readline() if ready else ""
            router.terminate()  # SIGTERM: the router drains (nothing in flight) and exits
            _, err = router.communicate(timeout=60)
        finally:
            reap(router)
    assert line.startswith("pagoda router at http://127.0.0.1:"), f"no URL, exit {router.returncode}:\n{err}"
    assert router.returncode == 0, err
