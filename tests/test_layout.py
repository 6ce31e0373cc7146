"""The rooms' dependencies point one way, read from the source (docs/architecture.md draws them).

Every `import pagoda.x` / `from pagoda.x import` in a module, including the ones inside functions, is a
dependency of its room. A room may import itself and the rooms listed for it, nothing else; the modules that
must load anywhere (the bookkeeping, the plugin interface) may not import torch at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagoda"

# room -> the other rooms it may import
ALLOWED = {
    "kernels": set(),
    "core": set(),
    "model": {"core", "kernels"},
    "simulator": {"core"},
    "plugins": {"core"},
    "api": {"core", "plugins"},
    "harness": {"api", "core", "model", "plugins", "simulator"},
    "bench": {"api", "core", "harness", "kernels", "model", "plugins", "simulator"},
    "cli": {"api", "bench", "core", "harness", "model", "plugins", "simulator"},
}
# Modules that must import without torch: the simulator drives the first, any plugin loads the second.
TORCH_FREE = ["core/request.py", "core/block_manager.py", "core/block_hash.py", "core/scheduler.py",
              "core/batch.py", "core/engine_config.py", "core/outputs.py", "core/sampling_params.py",
              "core/constraint.py", "plugins/protocol.py", "plugins/request_fields.py", "plugins/hookspecs.py",
              "plugins/manager.py", "plugins/client.py", "plugins/route.py", "plugins/disconnect.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module name a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


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
        for m in modules:
            if room_of(m):
                target = PACKAGE.parent / (m.replace(".", "/") + ".py")
                todo.append(target if target.exists() else target.with_suffix("") / "__init__.py")
