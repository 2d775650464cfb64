"""Both compaction engines write the same lake (issue 43 item 2): ``compact(spark, lake)`` (Spark's MERGE and
overwrite) and ``compact(None, lake)`` (delta-rs and pyarrow, no JVM) fold the same changes - inserts, updates,
deletes, a cache's drop, a field widening from int to double, datetimes, a new field, cache names with quotes, a
NUL and 200 x "é" - into equal ``state`` and typed tables, row for row and column type for column type, with the
same column comments and table properties, and record the same cut. The delta-rs engine's kills (between the
typed tables and ``state``, after ``state``'s commit before the cut) converge exactly once."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdcd.lake.cuts import latest_cut
from cdcd.lake.landing.delta import ChangeTable
from cdcd.lake.maintenance.compact import compact, compacted_version
from cdcd.lake.table import CHANGE_SCHEMA, STATE
from cdcd.lake.typed.infer import KEY
from cdcd.lake.typed.layout import list_tables
from tests.support.compaction import compact_env
from tests.support.delta_tables import change, expected_state, state_rows
from tests.support.procs import CDCD

CACHES = ["orders", "q'\"x", "nul\0x", "é" * 200]
AT = dt.datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=dt.UTC)


def land(lake: Path, rows: list[dict[str, Any]]) -> None:
    """One commit of ``rows`` into ``<lake>/changes`` through cdcd's writer (its directories take any name)."""
    table = ChangeTable(lake, False)
    table.open()
    full = [{"source_generation": 0, **r} for r in rows]
    files = table.write_arrow(pa.Table.from_pylist(full, schema=CHANGE_SCHEMA))
    table.table.create_write_transaction(files.adds, "append", table.schema, partition_by=table.partition_by)


def value(**fields: Any) -> str:
    return json.dumps(fields)


def stamp(i: int) -> str:
    """A datetime as the changes table holds it (msgspec's text: UTC, six fraction digits)."""
    return (AT + dt.timedelta(seconds=i)).isoformat(timespec="microseconds").replace("+00:00", "Z")


def dropped(cache: str, version: int) -> dict[str, Any]:
    return {**change(cache, "", None, version, op="truncate"), "key": None}


def rounds() -> list[list[dict[str, Any]]]:
    first = [
        change(c, str(k), value(id=k, price=k * 10, at=stamp(k), name=f"n{k}"), 100 + k)
        for c in CACHES
        for k in range(6)
    ]
    second = [
        *(change(c, "1", value(id=1, price=11, at=stamp(1), name="n1b"), 200) for c in CACHES),
        *(change(c, "2", None, 201) for c in CACHES),  # deletes
        change("orders", "3", value(id=3, price=2.5, at=stamp(3), name="n3"), 202),  # int -> double
        change("orders", "9", value(id=9, price=1, at=stamp(9), name="n9", extra=True), 203),  # a new field
        change(CACHES[1], "4", value(id=4, price=40, at=stamp(4), name="stale"), 50),  # older: loses
    ]
    third = [
        dropped(CACHES[2], 300),
        change(CACHES[2], "7", value(id=7, price=70, at=stamp(7), name="after"), 301),
        change(CACHES[3], "5", None, 302),
        change("orders", "10", value(id=10, price=3, at=stamp(10), name="n10", extra=False, more="m"), 303),
    ]
    fourth = [dropped(CACHES[3], 400), change("orders", "0", None, 401)]
    return [first, second, third, fourth]


def _comment(raw: str | None) -> Any:
    """A column comment without the wall-clock times it records."""
    if not raw:
        return raw
    info = json.loads(raw)
    info.pop("since", None)
    for step in info.get("widened") or []:
        step.pop("at", None)
    return info


def table_view(path: Path) -> dict[str, Any]:
    """What a reader sees of a Delta table: its rows (sorted), its columns' types and comments, its properties."""
    dt_ = DeltaTable(str(path))
    data = dt_.to_pyarrow_table()
    order = [c for c in ("cache", "key") if c in data.column_names]
    rows = data.sort_by([(c, "ascending") for c in order]).to_pylist() if order else data.to_pylist()
    fields = json.loads(dt_.schema().to_json())["fields"]
    meta = dt_.metadata()
    return {
        "rows": rows,
        "types": {f["name"]: f["type"] for f in fields},
        "comments": {f["name"]: _comment((f.get("metadata") or {}).get("comment")) for f in fields},
        "properties": dict(meta.configuration),
        "partitions": list(meta.partition_columns),
        "description": meta.description,
    }


def spark_types(spark: Any, path: Path) -> list[tuple[str, str]]:
    return [(f.name, f.dataType.simpleString()) for f in spark.read.format("delta").load(str(path)).schema.fields]


@pytest.mark.timeout(900)
def test_spark_and_deltalake_compaction_write_the_same_tables_and_cut(spark: Any, tmp_path: Path) -> None:
    on_spark, jvm_free = tmp_path / "spark", tmp_path / "deltalake"
    landed: list[dict[str, Any]] = []
    for rows in rounds():
        landed += rows
        for lake in (on_spark, jvm_free):
            land(lake, rows)
        r_spark = compact(spark, on_spark)
        r_free = compact(None, jvm_free)
        assert (r_spark.from_version, r_spark.to_version, r_spark.keys) == (
            r_free.from_version,
            r_free.to_version,
            r_free.keys,
        )
        assert (r_spark.inserted, r_spark.updated, r_spark.deleted) == (r_free.inserted, r_free.updated, r_free.deleted)
        assert r_spark.rescued == r_free.rescued
        assert table_view(on_spark / STATE) == table_view(jvm_free / STATE)
        data = [r for r in landed if r["op"] != "truncate"]
        assert state_rows(jvm_free) == {
            k: v for k, v in expected_state(data).items() if k[0] not in _dropped_before(landed, k)
        }
        tables_spark, tables_free = list_tables(on_spark), list_tables(jvm_free)
        assert sorted(tables_spark) == sorted(tables_free)
        for cache in tables_spark:
            assert table_view(tables_spark[cache]) == table_view(tables_free[cache]), cache
            assert spark_types(spark, tables_spark[cache]) == spark_types(spark, tables_free[cache])
        cut_spark, cut_free = latest_cut(on_spark), latest_cut(jvm_free)
        assert cut_spark is not None and cut_free is not None
        assert cut_spark.changes_version == cut_free.changes_version
        assert cut_spark.tables == cut_free.tables
        assert cut_spark.positions == cut_free.positions
    orders = table_view(list_tables(jvm_free)["orders"])
    assert orders["types"]["price"] == "double" and orders["types"]["at"] == "timestamp", orders["types"]
    assert {"extra", "more"} <= set(orders["types"])
    assert orders["comments"]["price"]["widened"][0]["from"] == "BIGINT"
    # Every reader reads the JVM-free engine's tables.
    import polars as pl

    from cdcd.lake.reading.readers import duckdb_connect

    for cache, path in list_tables(jvm_free).items():
        n = DeltaTable(str(path)).to_pyarrow_table().num_rows
        assert spark.read.format("delta").load(str(path)).count() == n, cache
        assert pl.read_delta(str(path)).height == n, cache
        with duckdb_connect() as con:
            escaped = str(path).replace("'", "''")
            assert con.execute(f"SELECT count(*) FROM delta_scan('{escaped}')").fetchone() == (n,), cache
    n_state = DeltaTable(str(jvm_free / STATE)).to_pyarrow_table().num_rows
    assert spark.read.format("delta").load(str(jvm_free / STATE)).count() == n_state


def _dropped_before(landed: list[dict[str, Any]], key: tuple[str, str]) -> set[str]:
    """The caches whose drop came after ``key``'s latest change (its row gone with the drop)."""
    cache = key[0]
    drops = [r["version_order"] for r in landed if r["op"] == "truncate" and r["cache"] == cache]
    last = max(r["version_order"] for r in landed if r["op"] != "truncate" and (r["cache"], r["key"]) == key)
    return {cache} if drops and max(drops) > last else set()


# --- kills during a delta-rs compaction ---------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["lake.compact.tables_committed", "lake.compact.committed"])
def test_a_jvm_free_compaction_killed_between_its_commits_converges_exactly_once(tmp_path: Path, point: str) -> None:
    """`cdcd lake compact` (no --spark-master: delta-rs) SIGKILLed with the typed tables committed and `state`
    not (or `state` committed and the cut not), then run again: `state` and every typed table hold each key's
    latest change exactly once, the mark is the changes version, and the cut covers it."""
    lake = tmp_path / "lake"
    landed: list[dict[str, Any]] = []
    for rows in rounds()[:2]:
        land(lake, rows)
        landed += rows
    first = subprocess.run([*CDCD, "lake", "compact", "--lake", str(lake)], capture_output=True, env=compact_env())
    assert first.returncode == 0, first.stderr[-3000:]
    rows = rounds()[2]
    land(lake, rows)
    landed += rows
    killed = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(lake)],
        capture_output=True,
        env=compact_env(CDCD_FAILPOINTS=point),
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    end = DeltaTable(str(lake / "changes")).version()
    orders = list_tables(lake)["orders"]
    assert DeltaTable(str(orders)).transaction_version("cdcd-compact") == end, "the typed tables committed"
    assert (compacted_version(lake) == end) == (point == "lake.compact.committed")
    cut = latest_cut(lake)
    assert cut is not None and cut.changes_version < end, "no cut yet"
    again = subprocess.run([*CDCD, "lake", "compact", "--lake", str(lake)], capture_output=True, env=compact_env())
    assert again.returncode == 0, again.stderr[-3000:]
    data = [r for r in landed if r["op"] != "truncate"]
    expected = {k: v for k, v in expected_state(data).items() if k[0] not in _dropped_before(landed, k)}
    assert state_rows(lake) == expected
    assert compacted_version(lake) == end
    cut = latest_cut(lake)
    assert cut is not None and cut.changes_version == end
    for cache, path in list_tables(lake).items():
        table = DeltaTable(str(path)).to_pyarrow_table(columns=[KEY])
        keys = table.column(KEY).to_pylist()
        assert len(keys) == len(set(keys)), f"{cache}: a key twice"
        assert sorted(json.dumps(k) for k in keys) == sorted(k for (c, k) in expected if c == cache), cache
        assert cut.tables[cache] == DeltaTable(str(path)).version()
    shutil.rmtree(tmp_path / "lake", ignore_errors=True)


# --- which engine ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "on_spark"),
    [
        ({"writer": "deltalake"}, False),  # JVM-free by default
        ({"writer": "deltalake", "spark_master": "local[1]"}, True),  # a Spark master named
        ({}, True),  # the Spark writer keeps Spark
        ({"compact_engine": "deltalake"}, False),
        ({"writer": "deltalake", "compact_engine": "spark"}, True),
    ],
)
def test_compact_engine_auto_is_spark_only_with_the_spark_writer_or_a_named_master(
    tmp_path: Path, options: dict[str, Any], on_spark: bool
) -> None:
    from cdcd.lake.sink import LakeConsumer

    consumer = LakeConsumer.from_options({"lake_path": str(tmp_path), **options}, "consumer")
    assert consumer.options.compacts_on_spark is on_spark


def test_an_unknown_compact_engine_is_one_line_naming_the_key(tmp_path: Path) -> None:
    from cdcd.config import ConfigError
    from cdcd.lake.sink import LakeConsumer

    with pytest.raises(ConfigError) as err:
        LakeConsumer.from_options({"lake_path": str(tmp_path), "compact_engine": "jvm"}, "consumer")
    assert str(err.value) == "consumer: key 'compact_engine': Invalid enum value 'jvm'"
    res = subprocess.run(
        [*CDCD, "lake", "compact", "--lake", str(tmp_path), "--engine", "jvm"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "'jvm' is not one of 'auto', 'spark', 'deltalake'" in res.stderr, res.stderr
