"""The project's Markdown as tests read it: its fenced code blocks, to run them as written (README.md:
``code_blocks``, ``block_with``; every page of docs/: ``fenced_blocks``, Python blocks run statement by statement
with ``run_python``)."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.procs import ROOT

README = ROOT / "README.md"


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def block_with(text: str, lang: str, marker: str) -> str:
    found = [b for b in code_blocks(text, lang) if marker in b]
    assert len(found) == 1, f"README: one ```{lang} block with {marker!r} expected, found {len(found)}"
    return found[0]


# --- every fenced block of a page, and running them as a reader would ----------------------------------------
DOCS = ROOT / "docs"


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown page: its language tag (``""`` when none), its text, its first line."""

    page: str
    lang: str
    text: str
    line: int

    def __str__(self) -> str:
        first = next((ln for ln in self.text.splitlines() if ln.strip()), "")
        return f"{self.page}:{self.line} ```{self.lang} {first[:70]!r}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` in page order, also one indented in a list item (its text dedented)."""
    text = path.read_text()
    out = []
    for m in re.finditer(r"^([ \t]*)```([\w+-]*)[ \t]*\n(.*?)^\1```[ \t]*$", text, flags=re.S | re.M):
        indent, body = m.group(1), m.group(3)
        lines = [ln.removeprefix(indent) for ln in body.splitlines(keepends=True)]
        out.append(Block(path.name, m.group(2), "".join(lines), text.count("\n", 0, m.start()) + 2))
    return out


def substitute(text: str, placeholders: Mapping[str, str]) -> str:
    """``text`` with each placeholder replaced (longest first, so one placeholder inside another is not cut)."""
    for name in sorted(placeholders, key=len, reverse=True):
        text = text.replace(name, placeholders[name])
    return text


@dataclass
class Cell:
    """One top-level statement of a Python block: its source as the page writes it, and the value of an
    expression statement, materialised (rows as dicts) right after it ran."""

    source: str
    value: Any = None


def materialise(value: Any) -> Any:
    """A reader's result as plain rows: a Spark DataFrame collected, a pyarrow table, polars frame or DuckDB
    relation as a list of dicts; any other value as it is."""
    module = type(value).__module__
    if module.startswith("pyspark") and hasattr(value, "collect"):
        return [row.asDict(recursive=True) for row in value.collect()]
    if module.startswith("pyarrow") and hasattr(value, "to_pylist"):
        return value.to_pylist()
    if module.startswith("polars"):
        if hasattr(value, "collect"):
            value = value.collect()
        return value.to_dicts()
    if module.startswith("duckdb") or module.startswith("_duckdb"):
        columns = value.columns
        return [dict(zip(columns, row, strict=True)) for row in value.fetchall()]
    return value


def run_python(block: Block, namespace: dict[str, Any], placeholders: Mapping[str, str]) -> list[Cell]:
    """Run ``block`` in ``namespace`` statement by statement, as a reader pasting it into a REPL (the
    placeholders substituted first); each expression statement's value is kept, materialised."""
    original = block.text.splitlines()
    text = substitute(block.text, placeholders)
    assert text.count("\n") == block.text.count("\n"), "a placeholder's value spans lines"
    cells = []
    for stmt in ast.parse(text).body:
        assert stmt.end_lineno is not None
        cell = Cell("\n".join(original[stmt.lineno - 1 : stmt.end_lineno]))
        name = f"<{block.page}:{block.line + stmt.lineno - 1}>"
        if isinstance(stmt, ast.Expr):
            code = compile(ast.Expression(stmt.value), name, "eval")
            cell.value = materialise(eval(code, namespace))
        else:
            exec(compile(ast.Module([stmt], type_ignores=[]), name, "exec"), namespace)
        cells.append(cell)
    return cells


def cell_with(cells: list[Cell], marker: str) -> Any:
    """The value of the one cell whose page source contains ``marker``."""
    found = [c for c in cells if marker in c.source]
    assert len(found) == 1, f"one statement with {marker!r} expected, found {[c.source for c in found]}"
    return found[0].value


def sh_commands(block: Block) -> list[tuple[str, list[str]]]:
    """The commands of a shell block, each with the output lines the page shows after it: a transcript
    (lines starting ``$ ``) has commands and output; any other block is commands only, one per line (a
    trailing ``\\`` continues it), comment lines and blank lines left out."""
    lines = block.text.splitlines()
    if any(line.startswith("$ ") for line in lines):
        out: list[tuple[str, list[str]]] = []
        for line in lines:
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif line.strip():
                assert out, f"{block}: output before any command"
                out[-1][1].append(line)
        return out
    commands: list[str] = []
    pending = ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        commands.append(pending + line)
        pending = ""
    assert not pending, f"{block}: a continued line without its end"
    return [(c, []) for c in commands]


def background(command: str) -> str | None:
    """The command without its ``&`` when the line ends in one (before any comment), else None."""
    m = re.fullmatch(r"(.*?[^&])\s*&\s*(#.*)?", command)
    return m.group(1) if m else None
