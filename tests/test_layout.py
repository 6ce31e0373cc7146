"""The rooms' dependencies point one way, read from the source (docs/architecture.md draws them).

Every `import pagoda.x` / `from pagoda.x import` in a module, including the ones inside functions and under
`if TYPE_CHECKING:`, is a dependency of its room. A room may import itself and the rooms listed for it, nothing
else; inside a room the modules' imports form no cycle; a built-in plugin imports no other built-in plugin; the
modules that must load anywhere (the bookkeeping, the plugin interface) may not import torch at all.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from pagoda.plugins.manager import BUILTIN_PLUGINS

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
# Modules that must import without torch: the simulator drives the first, any plugin loads the second.
TORCH_FREE = ["core/request.py", "core/block_manager.py", "core/block_hash.py", "core/scheduler.py",
              "core/batch.py", "core/engine_config.py", "core/scheduling.py", "core/outputs.py", "core/sampling_params.py",
              "core/constraint.py", "core/routing.py", "plugins/protocol.py", "plugins/request_fields.py",
              "plugins/hookspecs.py", "plugins/manager.py", "plugins/client.py", "plugins/route.py",
              "plugins/disconnect.py", "plugins/tools.py", "plugins/tool_stream.py", "plugins/tool_render.py",
              "plugins/error_shapes.py", "plugins/choices.py"]


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module name a file imports, at any depth (function-level and type-checking imports included).

    `from pagoda.x import y` names the module pagoda.x.y when y is a module of `package`, else pagoda.x."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
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


@pytest.mark.parametrize("name", TORCH_FREE)
def test_the_bookkeeping_and_the_plugin_interface_import_no_torch(name):
    """Not directly, and not through the pagoda modules they import."""
    seen, todo = set(), [PACKAGE / name]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        modules = imported_modules(path)
        assert not any(m == "torch" or m.startswith("torch.") for m in modules), f"{path} imports torch"
        todo.extend(target for m in modules if (target := module_path(m)) is not None)


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


@pytest.mark.parametrize("name", sorted(BUILTIN_PLUGINS))
def test_a_builtin_plugin_imports_no_other_builtin_plugin(name):
    """So each can be left out alone: what two built-ins share belongs in the plugin interface."""
    others = {module for other, module in BUILTIN_PLUGINS.items() if other != name}
    path = module_path(BUILTIN_PLUGINS[name])
    assert not imported_modules(path) & others, f"{name} imports {sorted(imported_modules(path) & others)}"
