"""Imports point one way (docs/design.md, "Layers"): every import of every cdcd module is parsed
and checked against the layer order, and the runtime imports between modules have no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cdcd

ROOT = Path(cdcd.__file__).parent

LAYERS: list[set[str]] = [
    {"cdcd.durable", "cdcd.secrets", "cdcd.failpoints", "cdcd.wiring", "cdcd.faults", "cdcd.retry", "cdcd.version"},
    {"cdcd.wal", "cdcd.logging", "cdcd.config", "cdcd.lock", "cdcd.formats"},
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


# --- docs/design.md says the same ---------------------------------------------------------------------------
DESIGN = ROOT.parent / "docs" / "design.md"


def _doc_unit(name: str) -> str:
    """A unit as docs/design.md names it (``wal/``, ``config.py``, ``cdcd/__init__.py``) as a module name."""
    if name == "cdcd/__init__.py":
        return "cdcd"
    return "cdcd." + name.removesuffix("/").removesuffix(".py")


def design_layer_rows() -> list[tuple[int, list[str], set[str] | None]]:
    """The layer table of docs/design.md section 8: (layer, units of a cell group, the units it says they import;
    None for "any lower unit"). A row lists several groups apart with `` · `` in both columns."""
    text = DESIGN.read_text()
    section = text[text.index("## 8. Layers") :]
    rows: list[tuple[int, list[str], set[str] | None]] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != 5 or not cells[1].isdigit():
            continue
        unit_groups = cells[2].split(" · ")
        import_groups = cells[3].split(" · ")
        assert len(unit_groups) == len(import_groups), f"docs/design.md: {line!r}: one imports group per unit group"
        for units, imports in zip(unit_groups, import_groups, strict=True):
            names = [n for n in re.findall(r"`([^`]+)`", units) if " " not in n]
            said = None if "any lower unit" in imports else {f"cdcd.{n}" for n in re.findall(r"`([^`]+)`", imports)}
            rows.append((int(cells[1]), [_doc_unit(n) for n in names], said))
    return rows


def test_design_md_layer_table_matches_the_code() -> None:
    """Every unit is in the table at its layer, and each row names exactly the units its modules import."""
    imported: dict[str, set[str]] = {}
    for module, imports in GRAPH.items():
        imported.setdefault(_unit(module), set()).update(_unit(t) for t, _line, _runtime in imports)
    wrong: list[str] = []
    listed: set[str] = set()
    for layer, units, said in design_layer_rows():
        listed |= set(units)
        for unit in units:
            if LAYER.get(unit) != layer:
                wrong.append(f"{unit}: layer {layer} in the doc, {LAYER.get(unit)} in LAYERS")
        if said is None:
            continue
        actual = set().union(*(imported.get(u, set()) for u in units)) - set(units)
        if said != actual:
            wrong.append(
                f"{', '.join(units)}: the doc says {sorted(n[5:] for n in said)}, the code imports "
                f"{sorted(n[5:] for n in actual)}"
            )
    missing = sorted(set(LAYER) - listed)
    assert not wrong and not missing, "docs/design.md section 8 is stale:\n" + "\n".join(
        wrong + [f"{u}: not in the table" for u in missing]
    )


def test_sinks_hold_no_wait_loops_of_their_own() -> None:
    """docs/design.md: "Sinks hold no retry loops of their own". A retry or a wait for a condition in the sinks goes
    through cdcd/retry.py (its backoff, its deadline, its stop), so no sink module calls ``time.sleep``."""
    sleeping = []
    for module, path in MODULES.items():
        if _unit(module) not in {"cdcd.lake", "cdcd.kafka", "cdcd.sinks", "cdcd.replication"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep":
                sleeping.append(f"{path}:{node.lineno}")
    assert "Sinks hold no retry\n  loops of their own" in DESIGN.read_text()
    assert not sleeping, f"a sink waits by hand (use cdcd.retry.retry_until or poll_until): {sleeping}"
