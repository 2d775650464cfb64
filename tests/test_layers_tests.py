"""The tests' own layering (docs/development.md): a test module imports cdcd and ``tests.support``, never another
test module. What two test files share is a rig, and rigs live in ``tests/support/``: importing a test module
also imports its tests and fixtures into the importer, so pytest collects them there too, and a change to one
file's tests breaks another's."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> set[str]:
    """Every ``tests.test_*`` module that ``source`` imports, at any depth (function bodies included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("tests.test_")}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("tests.test_"):
                found.add(node.module)
            elif node.module == "tests":
                found |= {f"tests.{a.name}" for a in node.names if a.name.startswith("test_")}
            elif node.level and node.module.startswith("test_"):
                found.add(f"tests.{node.module}")
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {
        path.name: sorted(imported)
        for path in sorted(TESTS.rglob("*.py"))
        if "support" not in path.relative_to(TESTS).parts and (imported := imported_test_modules(path.read_text()))
    }
    assert offenders == {}, f"move what they share into tests/support/: {offenders}"


def test_the_checker_sees_every_spelling() -> None:
    for source in (
        "from tests.test_a import x",
        "import tests.test_a",
        "from tests import test_a",
        "from .test_a import x",
        "def f():\n    from tests.test_a import x\n",
    ):
        assert imported_test_modules(source) == {"tests.test_a"}, source
    assert imported_test_modules("from tests.support.procs import wait_for\nimport tests.support") == set()
