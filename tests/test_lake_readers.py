"""Every reader the lake promises, against real Delta tables: Spark (format delta, SQL, time travel,
change data feed), deltalake -> pyarrow, polars, DuckDB (delta extension from its wheel, no network).
Each reads exactly the rows written; the README shows each of them in two lines."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.lake.maintenance.compact import compact
from cdcd.lake.table import CHANGES, STATE
from tests.support.delta_tables import append_changes, change, expected_state

FIRST = [change("orders", "1", '"a"', 1), change("orders", "2", '"b"', 2), change("new\nline", "1", '"n"', 3)]
SECOND = [change("orders", "1", None, 4), change("orders", "3", '"c"', 5)]


@pytest.fixture(scope="module")
def lake(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """changes at versions 0 and 1, state compacted from both."""
    root = tmp_path_factory.mktemp("readers") / "lake"
    append_changes(root, FIRST, source_txn=("node-a", 3))
    append_changes(root, SECOND, source_txn=("node-a", 5))
    compact(spark, root)
    return root


def keys_of(rows: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(r["cache"], r["key"]) for r in rows}


EXPECTED_STATE = expected_state(FIRST + SECOND)


def test_spark_reads_both_tables_by_format_and_sql(spark: Any, lake: Path) -> None:
    changes = spark.read.format("delta").load(str(lake / CHANGES))
    assert changes.count() == len(FIRST) + len(SECOND)
    state = spark.sql(f"SELECT cache, key, value FROM delta.`{lake / STATE}`").collect()
    assert {(r["cache"], r["key"]): r["value"] for r in state} == EXPECTED_STATE


def test_spark_time_travel_and_change_data_feed(spark: Any, lake: Path) -> None:
    v0 = spark.read.format("delta").option("versionAsOf", 0).load(str(lake / CHANGES))
    assert keys_of([r.asDict() for r in v0.collect()]) == keys_of(FIRST)
    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 1)
        .load(str(lake / CHANGES))
        .collect()
    )
    assert {(r["cache"], r["key"], r["op"], r["_change_type"], r["_commit_version"]) for r in feed} == {
        ("orders", "1", "delete", "insert", 1),
        ("orders", "3", "update", "insert", 1),
    }


def test_deltalake_to_pyarrow(lake: Path) -> None:
    from deltalake import DeltaTable

    table = DeltaTable(str(lake / STATE)).to_pyarrow_table()
    assert dict(zip(zip(table["cache"].to_pylist(), table["key"].to_pylist()), table["value"].to_pylist())) == (
        EXPECTED_STATE
    )
    assert DeltaTable(str(lake / CHANGES), version=0).to_pyarrow_table().num_rows == len(FIRST)


def test_polars(lake: Path) -> None:
    import polars as pl

    state = pl.read_delta(str(lake / STATE))
    assert {(r["cache"], r["key"]): r["value"] for r in state.iter_rows(named=True)} == EXPECTED_STATE
    per_cache = pl.scan_delta(str(lake / CHANGES)).group_by("cache").len().collect()
    assert dict(per_cache.iter_rows()) == {"orders": 4, "new\nline": 1}


def test_duckdb_with_the_delta_extension_from_its_wheel(lake: Path) -> None:
    """Loaded from the installed wheel with DuckDB's own autoinstall/autoload off: no network."""
    from cdcd.lake.reading.readers import duckdb_connect

    con = duckdb_connect()
    rows = con.execute(f"SELECT cache, key, value FROM delta_scan('{lake / STATE}')").fetchall()
    assert {(c, k): v for c, k, v in rows} == EXPECTED_STATE
    n = con.execute(f"SELECT count(*) FROM delta_scan('{lake / CHANGES}') WHERE op = 'delete'").fetchone()
    assert n == (1,)


def test_make_run_ending_queries_the_typed_tables_with_spark_sql(
    spark: Any, lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `make run` ends with: the lake path, the cut, a typed Spark SQL query over the cache tables
    (views at that cut) and its result, then one summary line (the checks here are `lake verify`'s)."""
    from cdcd.lake.cuts import latest_cut
    from cdcd.lake.reading.report import print_demo_ending
    from cdcd.lake.reading.verify import CacheCheck

    checks = [CacheCheck("new\nline", 1, 1, 7, 7), CacheCheck("orders", 2, 2, 9, 9)]
    cut = latest_cut(lake)
    assert cut is not None
    query = "SELECT count(*) AS keys, max(key) AS last_key FROM orders"
    print_demo_ending(spark, lake, checks, time.monotonic(), query)
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"verified: 3 keys, OK; stopped in \d+ s", out[-1]), out
    assert out[:-1] == [
        f"lake: {lake.resolve()}",
        f"tables at the cut of changes version {cut.changes_version} (cdcd lake cut --lake {lake})",
        f"spark.sql> {query}",
        "keys  last_key",
        "----  --------",
        "   2         3",
        "(1 row)",
    ]
