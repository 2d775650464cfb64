"""`cdcd lake history --table` and `cdcd lake check` cover every table of the lake (issue 43 item 3): `changes`,
`state`, `_cuts` and each typed table, named by its cache's name (hostile ones too: quotes, spaces, é, 255
characters, a NUL by its view name), with `tables/` in front or not. An unknown name is one line listing the
tables there (exit 2); a damaged typed table is named (exit 8). Real Delta tables: a node's WAL landed by the
lake sink (JVM-free writer) and compacted by `lake compact`'s JVM-free path into `state`, the typed tables and
`_cuts`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deltalake import DeltaTable

from cdcd.faults import ExitCode
from cdcd.lake.maintenance.compact import compact
from cdcd.lake.reading.readers import escape_view_name
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.typed.layout import table_dir
from cdcd.node import Node
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import wal_batch
from tests.support.procs import cdcd

QUOTES = 'it\'s "quoted"'
SPACES = "two  words "
ACCENTS = "é" * 200
LONG = "x" * 255
NUL = "a\x00b"
STATE_CACHE = "state"
"""A cache named like the state table: ``--table state`` is the table, ``--table tables/state`` the cache's."""
CACHES = ("orders", QUOTES, SPACES, ACCENTS, LONG, NUL, STATE_CACHE)


def _land(node_dir: Path, lake: Path, writes: dict[str, dict[str, int]]) -> None:
    """``writes`` put into the node (one cache each), landed in ``changes`` by the lake sink's JVM-free writer
    (one commit), then compacted JVM-free into ``state``, the typed tables and ``_cuts``."""
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        for cache, value in writes.items():
            node.cache(cache).put("k", value)
        node.force_archive()
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        assert sink.on_events(wal_batch(node_dir)) is True
    finally:
        sink.stop()
    compact(None, lake)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every cache landed and compacted twice: ``state``, ``_cuts`` and a typed table per cache, each with a
    history of more than one commit."""
    root = tmp_path_factory.mktemp("history")
    for n in (1, 2):
        _land(root / "node", root / "lake", {cache: {"n": n} for cache in CACHES})
    return root / "lake"


def _history(lake: Path, table: str) -> list[dict[str, object]]:
    res = cdcd("lake", "history", "--lake", str(lake), "--table", table, "--json")
    assert res.returncode == 0, (table, res.stderr)
    rows: list[dict[str, object]] = json.loads(res.stdout)
    return rows


def _versions(path: Path) -> list[int]:
    return [int(h["version"]) for h in DeltaTable(str(path)).history()]


def test_history_of_cuts_and_of_every_typed_table_by_its_caches_name(lake: Path) -> None:
    """`--table _cuts` and `--table <cache>` / `tables/<cache>` for every hostile name give that table's commits,
    newest first, as Delta's own history has them; a cache named `state` is reached as `tables/state`."""
    assert [h["version"] for h in _history(lake, "_cuts")] == _versions(lake / "_cuts")
    for cache in CACHES:
        if "\x00" in cache:
            continue  # no argument holds a NUL: the next test
        expected = _versions(Path(str(table_dir(lake, cache))))
        assert len(expected) >= 2, cache
        assert [h["version"] for h in _history(lake, f"tables/{cache}")] == expected, cache
        if cache != STATE_CACHE:
            assert [h["version"] for h in _history(lake, cache)] == expected, cache
    assert [h["version"] for h in _history(lake, "state")] == _versions(lake / "state")
    for table, shown in (("state", "state"), ("tables/state", "tables/state")):
        res = cdcd("lake", "history", "--lake", str(lake), "--table", table)
        assert res.returncode == 0, res.stderr
        assert all(line.startswith(f"{shown} ") for line in res.stdout.splitlines()[1:]), res.stdout


def test_a_cache_no_argument_can_spell_is_reached_by_its_view_name_or_directory(lake: Path) -> None:
    """A NUL cannot be passed in argv: the cache `a\\x00b` is `a#{0}b` (its view name in `lake sql`), or its
    directory under `tables/`; the table lines name it printably."""
    path = Path(str(table_dir(lake, NUL)))
    expected = _versions(path)
    assert [h["version"] for h in _history(lake, escape_view_name(NUL))] == expected
    assert [h["version"] for h in _history(lake, f"tables/{path.name}")] == expected
    res = cdcd("lake", "history", "--lake", str(lake), "--table", escape_view_name(NUL))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1 + len(expected)
    assert all(line.startswith("tables/a\\u0000b ") for line in lines[1:]), lines


def test_history_table_lines_name_the_table(lake: Path) -> None:
    """The text form's first column is the table as `history` names it: `_cuts`, `tables/<cache>`."""
    for table, shown in (("_cuts", "_cuts"), ("orders", "tables/orders"), (f"tables/{QUOTES}", f"tables/{QUOTES}")):
        res = cdcd("lake", "history", "--lake", str(lake), "--table", table, "--limit", "1")
        assert res.returncode == 0, res.stderr
        header, row = res.stdout.splitlines()
        assert header.split()[:2] == ["table", "version"]
        assert row.startswith(f"{shown} "), row


def test_an_unknown_table_is_one_line_listing_the_tables_there(lake: Path) -> None:
    res = cdcd("lake", "history", "--lake", str(lake), "--table", "nope")
    assert res.returncode == ExitCode.BAD_INPUT, res.stderr
    assert res.stdout == ""
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"cdcd: error: {lake}: no table 'nope'; tables there: changes, state, _cuts, "), line
    for cache in ("orders", QUOTES, SPACES, ACCENTS, LONG, STATE_CACHE):
        assert f"tables/{cache}" in line, cache
    assert f"tables/{escape_view_name(NUL)}" in line
    for name in ("tables/", "", "tables/nope", "..", "tables/.."):
        res = cdcd("lake", "history", "--lake", str(lake), "--table", name)
        assert res.returncode == ExitCode.BAD_INPUT, (name, res.stdout, res.stderr)
        assert len(res.stderr.splitlines()) == 1 and "tables there: changes" in res.stderr, res.stderr


def test_a_damaged_typed_tables_history_names_the_file(tmp_path: Path) -> None:
    """A typed table whose newest commit is torn: history exits 8 naming that commit file."""
    lake = tmp_path / "lake"
    _land(tmp_path / "node", lake, {"orders": {"n": 1}})
    path = Path(str(table_dir(lake, "orders")))
    newest = sorted((path / "_delta_log").glob("*.json"))[-1]
    newest.write_bytes(newest.read_bytes()[:-20])
    res = cdcd("lake", "history", "--lake", str(lake), "--table", "orders")
    assert res.returncode == ExitCode.DAMAGED_LAKE, (res.stdout, res.stderr)
    (line,) = res.stderr.splitlines()
    assert str(newest) in line, line


def test_lake_check_names_a_typed_tables_missing_data_file(tmp_path: Path) -> None:
    """A data file the typed table's log names is gone: `lake check` exits 8, its line names the file, and the
    table's summary line counts the fault; `changes`, `state` and `_cuts` check out."""
    lake = tmp_path / "lake"
    _land(tmp_path / "node", lake, {QUOTES: {"n": 1}})
    path = Path(str(table_dir(lake, QUOTES)))
    rels = DeltaTable(str(path)).get_add_actions(flatten=True).column("path").to_pylist()
    victim = path / rels[0]
    victim.unlink()
    res = cdcd("lake", "check", "--lake", str(lake))
    assert res.returncode == ExitCode.DAMAGED_LAKE, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"{victim}: named by the log (version "), lines
    assert "but missing" in lines[0]
    summary = {line.split(":")[0]: line for line in lines[1:]}
    assert summary[str(path)].endswith(": 1 fault(s)")
    assert all(summary[str(lake / t)].endswith(": ok") for t in ("changes", "state", "_cuts")), summary
