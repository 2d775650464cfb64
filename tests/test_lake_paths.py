"""A ``--lake`` that is no lake is named as such, with the right hint (issue 46): every ``cdcd lake`` command that
takes ``--lake`` answers a parent of the lake (``--lake var`` for ``var/lake``), a table inside it or a file
with ``<path>: not a cdcd lake (no changes/ table)`` and where the lake is, exit 2, before starting any JVM;
before, ``lake sql`` and ``lake cut`` said ``…/_cuts: no cut recorded yet (run cdcd lake compact)``. A lake that
was never compacted keeps that hint."""

from __future__ import annotations

from pathlib import Path

import click

from cdcd.cli.lake import lake as lake_group
from tests.support.delta_tables import append_changes, change
from tests.support.procs import cdcd


def make_var(tmp_path: Path) -> Path:
    """``<tmp>/var/lake``: a lake whose changes hold one row, never compacted."""
    lake = tmp_path / "var" / "lake"
    append_changes(lake, [change("orders", '"k"', '"v"', 1)])
    return lake


def invocations(tmp_path: Path, lake: str) -> dict[str, list[str]]:
    """Every ``cdcd lake`` command that takes ``--lake``, with whatever else it requires."""
    out: dict[str, list[str]] = {}
    for name, command in sorted(lake_group.commands.items()):
        params = {p.name: p for p in command.params}
        if "lake_path" not in params:
            continue
        args = ["lake", name, "--lake", lake]
        for param in command.params:
            if param.name == "node_dirs":
                args += ["--node-dir", str(tmp_path)]
            elif isinstance(param, click.Argument) and param.required:
                args.append("SELECT 1")
        out[name] = args
    return out


def test_every_lake_command_names_a_parent_of_the_lake_as_no_lake(tmp_path: Path) -> None:
    lake, var = make_var(tmp_path), tmp_path / "var"
    commands = invocations(tmp_path, str(var))
    assert {"check", "compact", "cut", "history", "optimize", "show", "sql", "vacuum", "verify"} <= set(commands)
    for name, args in commands.items():
        res = cdcd(*args)
        assert (res.returncode, res.stdout) == (2, ""), (name, res.stdout, res.stderr)
        assert res.stderr.splitlines() == [
            f"cdcd: error: {var}: not a cdcd lake (no changes/ table) (the lake is {lake}: pass --lake {lake})"
        ], name


def test_a_table_a_file_or_a_directory_far_from_any_lake(tmp_path: Path) -> None:
    lake = make_var(tmp_path)
    commit = lake / "changes" / "_delta_log" / f"{0:020d}.json"
    for path in (lake / "changes", commit):
        res = cdcd("lake", "sql", "--lake", str(path), "SELECT 1")
        assert res.returncode == 2
        assert res.stderr.splitlines() == [
            f"cdcd: error: {path}: not a cdcd lake (no changes/ table) (the lake is {lake}: pass --lake {lake})"
        ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = cdcd("lake", "check", "--lake", str(elsewhere))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"cdcd: error: {elsewhere}: not a cdcd lake (no changes/ table) (--lake is the lake sink's `lake_path`, "
        "the directory that holds changes/ and state/)"
    ]


def test_a_lake_never_compacted_keeps_its_hint(tmp_path: Path) -> None:
    lake = make_var(tmp_path)
    for args in (["sql", "SELECT 1"], ["cut"]):
        res = cdcd("lake", *args, "--lake", str(lake))
        assert res.returncode == 1
        assert res.stderr.splitlines() == [
            f"cdcd: error: {lake / '_cuts'}: no cut recorded yet (run cdcd lake compact)"
        ]
