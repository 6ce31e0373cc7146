"""No folder of the test suite can stand in for an installed distribution.

Under pytest's default import mode (prepend) a test module's basedir, the first folder above it that is not a
package, goes first on sys.path: every module and package in that folder is then importable by its bare name and
wins over an installed one. When tests/ was not a package, tests/kernels/ was importable as `kernels` and hid the
`kernels` distribution that transformers imports. With tests/__init__.py the repository root is the only basedir,
and the names it adds are `tests` and pagoda itself.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = {"pagoda"}  # this repository's distribution: the root's pagoda/ is the very code it installs


def basedir(path: Path) -> Path:
    """The folder pytest puts first on sys.path to import the module at `path`: the first one up that is no package."""
    folder = path.parent
    while (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def importable_names(tests: Path) -> dict[str, Path]:
    """Each top-level name that importing the modules under `tests` makes importable, with the file or folder it is.

    A folder without __init__.py is left out: a namespace package never wins over an installed package or module."""
    names: dict[str, Path] = {}
    for folder in {basedir(path) for path in tests.rglob("*.py")}:
        for entry in folder.iterdir():
            if entry.suffix == ".py":
                names[entry.stem] = entry
            elif (entry / "__init__.py").is_file():
                names[entry.name] = entry
    return names


def shadowed(names: dict[str, Path], distributions: dict[str, list[str]]) -> dict[str, list[str]]:
    """The names that are also an installed distribution's top-level module, each with those distributions."""
    return {name: sorted(set(distributions[name]) - OWN) for name in names
            if set(distributions.get(name, ())) - OWN}


def test_every_test_folder_is_a_package():
    loose = sorted({str(basedir(path).relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")} - {"."})
    assert not loose, f"give these folders an __init__.py, or their modules import by their bare names: {loose}"


def test_no_test_folder_shadows_an_installed_distribution():
    names = importable_names(ROOT / "tests")
    assert not shadowed(names, packages_distributions())
    assert "tests" in names


def test_the_check_catches_a_test_folder_named_after_a_distribution(tmp_path):
    tests = tmp_path / "tests"  # the old layout: tests/ no package, tests/kernels/ one
    for path in ["conftest.py", "helpers.py", "kernels/__init__.py", "kernels/test_paged.py", "core/__init__.py",
                 "core/test_engine.py"]:
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text("")
    installed = {"kernels": ["kernels"], "pagoda": ["pagoda"], "torch": ["torch"]}
    names = importable_names(tests)
    assert set(names) == {"conftest", "helpers", "kernels", "core"}
    assert shadowed(names, installed) == {"kernels": ["kernels"]}

    (tests / "__init__.py").write_text("")  # the layout now: one package, imported from the root
    (tmp_path / "pagoda").mkdir()
    (tmp_path / "pagoda" / "__init__.py").write_text("")
    names = importable_names(tests)
    assert set(names) == {"tests", "pagoda"}
    assert shadowed(names, installed) == {}
    assert shadowed(names, {**installed, "tests": ["sloppy-dist"]}) == {"tests": ["sloppy-dist"]}
