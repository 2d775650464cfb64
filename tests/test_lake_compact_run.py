"""A JVM-free compaction writes ``state``'s new files while its typed tables merge, and commits them after.

The files prepared for ``state`` are uncommitted until the typed tables have committed: a compaction
that fails in between (an error, not a kill: the kills are tests/test_lake_compact_engines.py's)
deletes them, leaves ``state`` at its old fold and version, and the next compaction folds the range
exactly once. Also: a range whose changes touch one file of a partition rewrites that file only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.maintenance.compact import compact, compacted_version
from cdcd.lake.table import STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.compaction import compact_env
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import CDCD


def data_files(table: Path) -> set[str]:
    return {str(p.relative_to(table)) for p in table.rglob("*.parquet") if "_delta_log" not in p.parts}


def live_files(table: Path) -> set[str]:
    import pyarrow as pa

    return set(pa.table(DeltaTable(str(table)).get_add_actions(flatten=True)).column("path").to_pylist())


def test_a_compaction_failing_after_its_typed_tables_leaves_no_state_file_and_state_unchanged(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    first = [change(c, str(k), f'{{"n": {k}}}', k) for k in range(40) for c in ("orders", "users")]
    append_changes(lake, first)
    compact(None, lake)
    before_rows, before_files = state_rows(lake), data_files(lake / STATE)
    before_version = DeltaTable(str(lake / STATE)).version()
    assert before_rows == expected_state(first)
    second = [change(c, str(k), f'{{"n": {k + 1000}}}', 1000 + k) for k in range(0, 60, 3) for c in ("orders", "users")]
    second += [change("orders", "7", None, 2000)]
    end = append_changes(lake, second)

    failing = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(lake)],
        capture_output=True,
        env=compact_env(CDCD_FAILPOINTS="lake.compact.tables_committed=raise"),
        timeout=600,
    )
    assert failing.returncode != 0, failing.stderr[-3000:]
    assert b"tables_committed" in failing.stderr, failing.stderr[-3000:]
    orders = list_tables(lake)["orders"]
    assert DeltaTable(str(orders)).transaction_version("cdcd-compact") == end, "the typed tables committed"
    assert DeltaTable(str(lake / STATE)).version() == before_version
    assert compacted_version(lake) < end
    assert state_rows(lake) == before_rows
    assert data_files(lake / STATE) == before_files, "the files prepared for state were deleted"

    compact(None, lake)
    assert state_rows(lake) == expected_state(first + second)
    assert compacted_version(lake) == end
    assert DeltaTable(str(lake / STATE)).version() == before_version + 1, "one commit for the range"
    keys = DeltaTable(str(orders)).to_pyarrow_table(columns=["key"]).column("key").to_pylist()
    assert sorted(keys) == sorted(int(k) for (c, k) in expected_state(first + second) if c == "orders")


def test_a_range_touching_one_cache_rewrites_only_that_cache_s_files(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows = [change(c, str(k), f'{{"n": {k}}}', k) for k in range(20) for c in ("orders", "users")]
    append_changes(lake, rows)
    compact(None, lake)
    users = {p for p in data_files(lake / STATE) if p.startswith("cache=users/")}
    more = [change("orders", "3", '{"n": 99}', 500)]
    append_changes(lake, more)
    compact(None, lake)
    after = data_files(lake / STATE)
    assert users <= after
    live = live_files(lake / STATE)
    assert {p.split("/", 1)[0] for p in live} == {"cache=orders", "cache=users"}
    assert {p for p in live if p.startswith("cache=users/")} == users, "the untouched cache's file stays"
    assert state_rows(lake) == expected_state(rows + more)
