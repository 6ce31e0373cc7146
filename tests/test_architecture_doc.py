"""docs/architecture.md names every room and every hook: its tables are read against the tree.

The rooms are the packages of pagoda/ (every folder below it with an `__init__.py`, nested ones such as
model/families included), the hooks the `@hookspec` functions of pagoda/plugins/hookspecs.py, and the
dependency table is tests/test_layout.py's ALLOWED. A row missing, or a row naming what the tree does not
have, fails; a test removes each row in turn from a copy of the text to prove the check sees it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_layout import ALLOWED, PACKAGE

DOC = PACKAGE.parent / "docs" / "architecture.md"
HOOKSPECS = PACKAGE / "plugins" / "hookspecs.py"
ROOMS_TABLE, HOOKS_TABLE, DEPENDENCY_TABLE = "folder", "hook", "room"  # each table's first header cell
_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def rooms(package: Path = PACKAGE) -> set[str]:
    """Every package under `package`, as the rooms table spells it: `core/`, `model/families/`."""
    return {init.parent.relative_to(package).as_posix() + "/" for init in package.rglob("__init__.py")
            if init.parent != package}


def hookspecs(path: Path = HOOKSPECS) -> set[str]:
    """The names of the functions `path` marks `@hookspec` (bare, or called with options)."""
    def is_hookspec(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Name) and target.id == "hookspec"

    tree = ast.parse(path.read_text(), str(path))
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and any(map(is_hookspec, node.decorator_list))}


def cells(line: str) -> list[str]:
    """A table row's cells, stripped (a `\\|` inside a cell is not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def tables(text: str) -> dict[str, list[list[str]]]:
    """The document's tables by their header's first cell, each as its body rows; a header used twice is an error."""
    found: dict[str, list[list[str]]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and _SEPARATOR.match(lines[i + 1]):
            header = cells(lines[i])[0]
            assert header not in found, f"two tables of {DOC.name} begin with the header {header!r}"
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            found[header] = rows
        else:
            i += 1
    return found


def first_names(rows: list[list[str]]) -> list[str]:
    """Each row's first cell as a name: its first backticked word, less a call's arguments."""
    names = []
    for row in rows:
        quoted = re.findall(r"`([^`]+)`", row[0])
        names.append((quoted[0] if quoted else row[0]).split("(")[0])
    return names


def problems(text: str) -> list[str]:
    """What the rooms and hooks tables of `text` miss, or name that the tree does not have; [] when none."""
    found = tables(text)
    out = []
    for what, table, expected in (("room", ROOMS_TABLE, rooms()), ("hook", HOOKS_TABLE, hookspecs())):
        if table not in found:
            out.append(f"no table whose header begins with {table!r}")
            continue
        named = first_names(found[table])
        out += [f"the {what} {name} has no row in the {what}s table" for name in sorted(expected - set(named))]
        out += [f"the {what}s table names {name}, which the tree does not have" for name in sorted(set(named) - expected)]
        out += [f"the {what}s table names {name} twice" for name in sorted({n for n in named if named.count(n) > 1})]
    return out


def without_row(text: str, name: str) -> str:
    """`text` less the table row whose first cell names `name` (a room, or a hook: its arguments follow)."""
    kept = [line for line in text.splitlines(keepends=True)
            if not line.startswith((f"| `{name}` |", f"| `{name}("))]
    assert len(kept) == len(text.splitlines()) - 1, f"no single row for {name!r}"
    return "".join(kept)


def test_the_tree_has_what_the_check_reads():
    """The discovery itself: a nested package and the seven hooks, so an empty reading cannot pass."""
    assert {"core/", "model/", "model/families/", "plugins/builtin/", "router/"} <= rooms()
    assert "pagoda_register_protocols" in hookspecs() and len(hookspecs()) >= 7


def test_every_room_and_every_hook_has_its_row():
    assert problems(DOC.read_text()) == []


def test_the_dependency_table_is_the_layout_tests():
    """The `room | may import` table says what tests/test_layout.py enforces, no more and no less."""
    rows = tables(DOC.read_text())[DEPENDENCY_TABLE]
    doc = {first_names([row])[0]: set(re.findall(r"`([^`]+)`", row[1])) for row in rows}
    assert doc == ALLOWED


@pytest.mark.parametrize("name", sorted(rooms()) + sorted(hookspecs()))
def test_a_removed_row_is_named(name):
    text = without_row(DOC.read_text(), name)
    assert any(name in problem and "has no row" in problem for problem in problems(text)), problems(text)
