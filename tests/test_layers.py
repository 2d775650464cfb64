"""Imports point one way (docs/design.md, "Layers"): every import of every cdcd module is parsed
and checked against the layer order, and the runtime imports between modules have no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import cdcd

ROOT = Path(cdcd.__file__).parent

LAYERS: list[set[str]] = [
    {"cdcd.durable", "cdcd.secrets", "cdcd.failpoints", "cdcd.wiring", "cdcd.faults", "cdcd.retry", "cdcd.version"},
    {"cdcd.wal", "cdcd.logging", "cdcd.config", "cdcd.lock"},
    {"cdcd.metrics", "cdcd.control", "cdcd.consumer", "cdcd.daemon_state"},
    {"cdcd.delivery", "cdcd.dead_letters"},
    {"cdcd.node"},
    {"cdcd.replication", "cdcd.realtime", "cdcd.daemon"},
    {"cdcd.lake", "cdcd.kafka", "cdcd.top"},
    {"cdcd.sinks"},
    {"cdcd", "cdcd.demo"},
    {"cdcd.cli"},
    {"cdcd.__main__"},
]
"""Lowest first. A unit (a package below ``cdcd``, or a top-level module) imports only units of
lower layers; units of one layer do not import each other. ``cdcd`` itself (``__init__.py``) is the
composition root that wires realtime delivery and the replication endpoint into every node."""

LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return module
    return ".".join(parts[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported cdcd module, line, runtime) of every import in ``path``; ``runtime`` is False under
    ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno, runtime) for a in node.names if a.name.split(".")[0] == "cdcd")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] == "cdcd":
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if sub in MODULES else base, node.lineno, runtime))
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(tree, True)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_unit_has_a_layer() -> None:
    missing = sorted({_unit(m) for m in MODULES} - LAYER.keys())
    assert not missing, f"units without a layer in LAYERS (and docs/design.md): {missing}"


def test_imports_point_down() -> None:
    upward = []
    for module, imports in GRAPH.items():
        src = _unit(module)
        for target, line, _runtime in imports:
            dst = _unit(target)
            if dst != src and LAYER[dst] >= LAYER[src] and (module, target) not in KNOWN_UPWARD:
                upward.append(f"{MODULES[module]}:{line}: {module} imports {target} ({src} may not import {dst})")
    assert not upward, "\n".join(sorted(set(upward)))


def test_no_import_cycles_at_run_time() -> None:
    edges = {
        m: {t for t, _line, runtime in imports if runtime and t in MODULES and t != m and (m, t) not in KNOWN_UPWARD}
        for m, imports in GRAPH.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :]
                if frozenset(cycle) not in KNOWN_CYCLES:
                    cycles.append([*cycle, t])
            elif t not in state:
                walk(t)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_upward_and_cyclic_imports(tmp_path: Path) -> None:
    """The parser finds plain, from-, relative and function-local imports, and skips TYPE_CHECKING ones."""
    src = tmp_path / "mod.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import cdcd.sinks\n"
        "from cdcd import metrics\n"
        "from . import writes\n"
        "if TYPE_CHECKING:\n"
        "    from cdcd.daemon import Daemon\n"
        "def f():\n"
        "    from cdcd.realtime.worker import RealtimeWorker\n"
    )
    got = _imports("cdcd.node.mod", src)
    assert got == [
        ("cdcd.sinks", 2, True),
        ("cdcd.metrics", 3, True),
        ("cdcd.node.writes", 4, True),
        ("cdcd.daemon", 6, False),
        ("cdcd.realtime.worker", 8, True),
    ]
