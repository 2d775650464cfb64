"""Types that widen instead of rescuing (issue 43 §3, docs/lake.md "Types"): one lattice, int64 < float64,
date < timestamp, scalars meeting at string; a datetime the node holds lands as TIMESTAMP, a date as DATE.
A widening rewrites the table at that compaction in one overwrite commit (no Delta type-widening feature), so
Spark, delta-rs, polars and DuckDB each read every version; values rescued before a widening that the wider
type takes are restored into the column; what fits no type (a dict where a scalar is) stays in ``_rescued``;
``cdcd lake show`` lists when each column appeared and when it widened."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest

from cdcd.lake.cuts import latest_cut
from cdcd.lake.landing.jsontext import to_json_bytes
from cdcd.lake.maintenance.compact import compact
from cdcd.lake.table import CHANGE_SCHEMA
from cdcd.lake.typed.infer import (
    KEY,
    META_COLUMNS,
    RESCUED,
    Layout,
    convert,
    rebuild,
    temporal,
)
from cdcd.lake.typed.layout import read_layout, table_dir
from cdcd.lake.typed.show import tables_show
from tests.support.delta_tables import append_changes, change
from tests.support.procs import cdcd

UTC = dt.UTC
PLUS_2 = dt.timezone(dt.timedelta(hours=2))
READERS = ("spark", "delta-rs", "polars", "duckdb")


def landed(value: object) -> str:
    """A node value's JSON text as the lake's writers land it: the node's MessagePack (an aware datetime is a
    timestamp, extension -1; a date and a naive datetime are text), through the writers' own definition."""
    return to_json_bytes(msgspec.msgpack.encode(value)).decode()


def canonical(value: object) -> bytes:
    """JSON with sorted keys: 1, 1.0 and "1" stay three different values."""
    return msgspec.json.encode(value, order="sorted")


def rows_of(changes: Sequence[tuple[int, object]], first_version: int, cache: str = "orders") -> list[dict[str, Any]]:
    return [
        change(cache, str(key), None if value is None else landed(value), first_version + i)
        for i, (key, value) in enumerate(changes)
    ]


# --- the rules, without Spark ----------------------------------------------------------------------------------
def test_the_lattice_on_one_batch_after_another() -> None:
    """Column by column, as ``convert`` types them: an int column meeting a double widens to DOUBLE (its ints
    with it), a DATE column meeting a timestamp to TIMESTAMP, a numeric column meeting a string to STRING (each
    value its JSON text); an int a double does not hold exactly, and a dict where a scalar is, stay in
    ``_rescued``, exactly; a naive datetime's text, a date with another offset, are strings."""
    columns = ["op", "key", "value", *(src for _, _, src in META_COLUMNS), "cache"]

    def batch(changes: Sequence[tuple[int, object]], first: int) -> pa.Table:
        return pa.Table.from_pylist(rows_of(changes, first), schema=CHANGE_SCHEMA).select(columns)

    first = convert(
        batch(
            [
                (1, {"n": 1, "at": dt.datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC), "day": dt.date(2026, 3, 1)}),
                (2, {"n": 2, "at": dt.datetime(2026, 3, 2, tzinfo=PLUS_2), "naive": dt.datetime(2026, 1, 1)}),
            ],
            1,
        ),
        Layout(),
    )
    types = {f: t for f, (_, t) in first.layout.columns.items()}
    assert types == {
        "n": pa.int64(),
        "at": pa.timestamp("us", tz="UTC"),
        "day": pa.date32(),
        "naive": pa.string(),
    }
    assert first.rows.column("at").to_pylist() == [
        dt.datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC),
        dt.datetime(2026, 3, 1, 22, 0, tzinfo=UTC),  # the instant, in UTC
    ]
    assert first.widened == {} and first.rescued == 0

    second = convert(
        batch([(3, {"n": 2.5, "day": dt.datetime(2026, 3, 3, 6, tzinfo=UTC)}), (4, {"n": (1 << 53) + 1})], 10),
        first.layout,
    )
    assert second.widened == {
        "n": (pa.int64(), pa.float64()),
        "day": (pa.date32(), pa.timestamp("us", tz="UTC")),
    }
    got = {row[KEY]: (rebuild(row, second.layout), row[RESCUED]) for row in second.rows.to_pylist()}
    assert {k: (canonical(v), r) for k, (v, r) in got.items()} == {
        3: (canonical({"n": 2.5, "day": "2026-03-03T06:00:00Z"}), None),
        4: (canonical({"n": (1 << 53) + 1}), '{"n":9007199254740993}'),  # not exactly a double: kept exactly
    }

    third = convert(batch([(5, {"n": "n/a", "day": {"d": 1}}), (6, {"n": 6, "day": "2026-03-06"})], 20), second.layout)
    assert third.widened == {"n": (pa.float64(), pa.string())}
    got = {row[KEY]: (rebuild(row, third.layout), row[RESCUED]) for row in third.rows.to_pylist()}
    assert {k: (canonical(v), r) for k, (v, r) in got.items()} == {
        5: (canonical({"n": "n/a", "day": {"d": 1}}), '{"day":{"d":1}}'),  # a dict where a scalar is: rescued
        6: (canonical({"n": "6", "day": "2026-03-06T00:00:00Z"}), None),
    }
    # Only the exact text of a UTC datetime or a date is one.
    assert temporal("2026-03-01T12:00:00Z") == pa.timestamp("us", tz="UTC")
    assert temporal("2026-03-01") == pa.date32()
    for text in ("2026-03-01T12:00:00", "2026-03-01T12:00:00+02:00", "2026-03-01T12:00:00.000000Z", "2026-02-30"):
        assert temporal(text) is None, text
    assert temporal("\uff12\uff10\uff12\uff16-03-01") is None  # other digits


# --- compaction, four readers ----------------------------------------------------------------------------------
def read_rows(path: object, reader: str, spark: Any) -> pa.Table:
    if reader == "spark":
        return spark.read.format("delta").load(str(path)).toArrow()
    if reader == "delta-rs":
        from deltalake import DeltaTable

        return DeltaTable(str(path)).to_pyarrow_table()
    if reader == "polars":
        import polars as pl

        return pl.read_delta(str(path)).to_arrow()
    from cdcd.lake.reading.readers import duckdb_connect

    sql = "SELECT * FROM delta_scan('" + str(path).replace("'", "''") + "')"
    return duckdb_connect().sql(sql).arrow().read_all()


KIND = {
    "BIGINT": pa.types.is_int64,
    "DOUBLE": pa.types.is_float64,
    "STRING": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t),
    "TIMESTAMP": lambda t: pa.types.is_timestamp(t) and t.tz is not None and t.tz.upper() in ("UTC", "ETC/UTC"),
    "DATE": pa.types.is_date32,
}


def check(
    lake: Path,
    spark: Any,
    cache: str,
    types: Mapping[str, str],
    want: Mapping[int, tuple[object, object]],
    *,
    cut: bool = True,
) -> None:
    """Each reader reads the table with these column types (Spark SQL names), one row per key, each rebuilding
    exactly ``want``'s value with exactly ``want``'s ``_rescued`` (None, or its JSON); the table has no
    type-widening (or column-mapping) table feature, and (``cut``) the latest cut names its latest version."""
    from deltalake import DeltaTable

    path = table_dir(lake, cache)
    layout = read_layout(path)
    columns = {f: c for f, (c, _) in layout.columns.items()}
    table = DeltaTable(str(path))
    protocol = table.protocol()
    assert not (set(protocol.reader_features or []) | set(protocol.writer_features or [])) & {
        "typeWidening",
        "typeWidening-preview",
        "columnMapping",
    }
    latest = latest_cut(lake)
    assert not cut or (latest is not None and latest.tables[cache] == table.version())
    for reader in READERS:
        rows = read_rows(path, reader, spark)
        for field, kind in types.items():
            t = rows.schema.field(columns[field]).type
            assert KIND[kind](t), (reader, field, t)
        got: dict[int, tuple[bytes, object]] = {}
        for row in rows.to_pylist():
            assert row[KEY] not in got, (reader, row[KEY])
            rescued = None if row[RESCUED] is None else msgspec.json.decode(row[RESCUED])
            got[row[KEY]] = (canonical(rebuild(row, layout)), rescued)
        assert got == {k: (canonical(v), r) for k, (v, r) in want.items()}, reader


@pytest.mark.timeout(1200)  # four compactions, a few Spark jobs each: minutes on a loaded 2-core machine
def test_a_field_widening_int_double_string_and_datetimes_read_by_every_reader(spark: Any, tmp_path: Path) -> None:
    """A cache whose ``amount`` goes int -> double -> string and whose ``day`` goes date -> timestamp, beside an
    aware datetime (TIMESTAMP, UTC) and a naive one (STRING): after each compaction Spark, delta-rs, polars and
    DuckDB read the table with the documented types and every live value exactly as the lattice types it;
    2^60 (no double holds it exactly) is rescued while ``amount`` is DOUBLE and restored into it as text when
    it widens to STRING; a dict stays rescued throughout. A second cache stands for a table typed before
    anything widened (an int rescued from its DOUBLE column, its key's comment without a lattice): its next
    compaction restores that int into the column once. ``cdcd lake show`` lists each widening."""
    lake = tmp_path / "lake"
    at1 = dt.datetime(2026, 3, 1, 12, 0, 0, 500000, tzinfo=UTC)
    at2 = dt.datetime(2026, 3, 2, tzinfo=PLUS_2)
    first = [
        (1, {"amount": 1, "at": at1, "day": dt.date(2026, 3, 1), "note": "a"}),
        (2, {"amount": 2, "at": at2, "day": dt.date(2026, 3, 2)}),
        (3, {"amount": 1 << 60, "day": dt.date(2026, 3, 3)}),
        (4, {"amount": {"n": 1}}),
        (5, {"amount": 5, "naive": dt.datetime(2026, 1, 1)}),
        (6, {"amount": 6}),
    ]
    legacy = [(1, {"price": 1.5}), (2, {"price": 100})]
    append_changes(lake, rows_of(first, 1) + rows_of(legacy, 50, "legacy"), source_txn=("node-a", 1))
    compact(spark, lake)
    types = {"amount": "BIGINT", "at": "TIMESTAMP", "day": "DATE", "note": "STRING", "naive": "STRING"}
    check(
        lake,
        spark,
        "orders",
        types,
        {
            1: ({"amount": 1, "at": "2026-03-01T12:00:00.500000Z", "day": "2026-03-01", "note": "a"}, None),
            2: ({"amount": 2, "at": "2026-03-01T22:00:00Z", "day": "2026-03-02"}, None),
            3: ({"amount": 1 << 60, "day": "2026-03-03"}, None),
            4: ({"amount": {"n": 1}}, {"amount": {"n": 1}}),
            5: ({"amount": 5, "naive": "2026-01-01T00:00:00"}, None),
            6: ({"amount": 6}, None),
        },
    )
    check(lake, spark, "legacy", {"price": "DOUBLE"}, {1: ({"price": 1.5}, None), 2: ({"price": 100.0}, None)})
    # The legacy table as a cdcd that did not widen left it: 100 rescued, the key's comment naming no lattice.
    legacy_path = table_dir(lake, "legacy")
    spark.sql(f"UPDATE delta.`{legacy_path}` SET price = NULL, {RESCUED} = '{{\"price\":100}}' WHERE key = 2")
    old_comment = json.dumps({"key": "typed", "since_version": 0, "since": "2026-01-01T00:00:00+00:00"})
    spark.sql(f"ALTER TABLE delta.`{legacy_path}` ALTER COLUMN key COMMENT '{old_comment}'")
    tampered = {1: ({"price": 1.5}, None), 2: ({"price": 100}, {"price": 100})}
    check(lake, spark, "legacy", {"price": "DOUBLE"}, tampered, cut=False)

    second = [
        (2, {"amount": 2.5, "at": at2, "day": dt.datetime(2026, 3, 2, 6, tzinfo=UTC)}),
        (7, {"amount": 7, "day": dt.date(2026, 3, 7)}),
    ]
    append_changes(lake, rows_of(second, 100) + rows_of([(3, {"price": 2.5})], 150, "legacy"), source_txn=("node-a", 2))
    result = compact(spark, lake)
    assert result.rescued == 0, result  # the range's own fields: each fits the wider columns
    types |= {"amount": "DOUBLE", "day": "TIMESTAMP"}
    check(
        lake,
        spark,
        "orders",
        types,
        {
            1: ({"amount": 1.0, "at": "2026-03-01T12:00:00.500000Z", "day": "2026-03-01T00:00:00Z", "note": "a"}, None),
            2: ({"amount": 2.5, "at": "2026-03-01T22:00:00Z", "day": "2026-03-02T06:00:00Z"}, None),
            3: ({"amount": 1 << 60, "day": "2026-03-03T00:00:00Z"}, {"amount": 1 << 60}),
            4: ({"amount": {"n": 1}}, {"amount": {"n": 1}}),
            5: ({"amount": 5.0, "naive": "2026-01-01T00:00:00"}, None),
            6: ({"amount": 6.0}, None),
            7: ({"amount": 7.0, "day": "2026-03-07T00:00:00Z"}, None),
        },
    )
    legacy_want = {1: ({"price": 1.5}, None), 2: ({"price": 100.0}, None), 3: ({"price": 2.5}, None)}
    check(lake, spark, "legacy", {"price": "DOUBLE"}, legacy_want)  # 100 restored, once

    third = [(6, {"amount": "n/a"}), (1, None)]
    append_changes(lake, rows_of(third, 200), source_txn=("node-a", 3))
    result = compact(spark, lake)
    assert result.rescued == 0, result
    types["amount"] = "STRING"
    orders_want: dict[int, tuple[object, object]] = {
        2: ({"amount": "2.5", "at": "2026-03-01T22:00:00Z", "day": "2026-03-02T06:00:00Z"}, None),
        3: ({"amount": str(1 << 60), "day": "2026-03-03T00:00:00Z"}, None),  # restored into the column
        4: ({"amount": {"n": 1}}, {"amount": {"n": 1}}),
        5: ({"amount": "5", "naive": "2026-01-01T00:00:00"}, None),  # each value's own text, from state
        6: ({"amount": "n/a"}, None),
        7: ({"amount": "7", "day": "2026-03-07T00:00:00Z"}, None),
    }
    check(lake, spark, "orders", types, orders_want)
    check(lake, spark, "legacy", {"price": "DOUBLE"}, legacy_want)

    # Nothing new: nothing rewritten, the same versions and rows.
    from deltalake import DeltaTable

    versions = {c: DeltaTable(str(table_dir(lake, c))).version() for c in ("orders", "legacy")}
    assert not compact(spark, lake).did_work
    assert {c: DeltaTable(str(table_dir(lake, c))).version() for c in versions} == versions
    check(lake, spark, "orders", types, orders_want)

    # When each column appeared and widened: the comments, lake show's JSON and its lines.
    shows = {s.cache: s for s in tables_show(lake)}
    columns = {c.column: c for c in shows["orders"].columns}
    assert [(w["from"], w["to"]) for w in columns["amount"].widened] == [("BIGINT", "DOUBLE"), ("DOUBLE", "STRING")]
    assert [(w["from"], w["to"]) for w in columns["day"].widened] == [("DATE", "TIMESTAMP")]
    assert columns["at"].widened == [] and columns["at"].type == "TIMESTAMP"
    assert columns["amount"].since_version == 0 and shows["orders"].rescued_rows == 1
    rewrites = [w["version"] for w in columns["amount"].widened]
    history = {h["version"]: h for h in DeltaTable(str(table_dir(lake, "orders"))).history()}
    for version in rewrites:  # each widening: one overwrite commit, every file replaced
        assert history[version]["operation"] == "WRITE", history[version]
        assert history[version]["operationParameters"]["mode"] == "Overwrite", history[version]
    # The change data feed: typed changes from the last rewrite on; across it, Delta refuses a batch read.
    feed_path = str(table_dir(lake, "orders"))

    def feed(start: int) -> list[Any]:
        reader = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", start)
        return reader.load(feed_path).where("_change_type <> 'update_preimage'").collect()  # type: ignore[no-any-return]

    assert {(r["key"], r["amount"], r["_change_type"]) for r in feed(rewrites[1] + 1)} == {
        (6, "n/a", "update_postimage"),
        (1, "1", "delete"),
    }
    with pytest.raises(Exception, match=r"(?i)schema"):
        feed(0)
    out = cdcd("lake", "show", "--lake", str(lake))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(f"widened BIGINT -> DOUBLE at version {rewrites[0]}" in line for line in lines), out.stdout
    assert any(f"widened DOUBLE -> STRING at version {rewrites[1]}" in line for line in lines), out.stdout
    shown = msgspec.json.decode(cdcd("lake", "show", "--lake", str(lake), "--json").stdout)
    orders = next(t for t in shown["typed_tables"] if t["cache"] == "orders")
    assert [w["to"] for w in next(c for c in orders["columns"] if c["column"] == "amount")["widened"]] == [
        "DOUBLE",
        "STRING",
    ]


@pytest.mark.timeout(1200)  # a compaction in a JVM of its own, killed, then one in-process
def test_a_compaction_killed_between_the_rewrite_and_the_merge_redoes_the_range(spark: Any, tmp_path: Path) -> None:
    """SIGKILL of `cdcd lake compact` right after a widening rewrote the table and before the range's MERGE: the
    table holds the wider type and every row as of the range's start, its application transaction and the cut
    still name the range before; the next compaction merges the range into the wider table (no second rewrite)
    and every row is exact."""
    import signal

    from deltalake import DeltaTable

    from cdcd.lake.maintenance.compact import COMPACT_APP_ID, compacted_version
    from tests.support.compaction import compact_env, kill_group, run_compact

    lake = tmp_path / "lake"
    path = table_dir(lake, "orders")
    before = append_changes(lake, rows_of([(1, {"n": 1}), (2, {"n": 1 << 60}), (3, {"n": 3})], 1), source_txn=("a", 1))
    compact(spark, lake)
    created = DeltaTable(str(path)).version()
    version = append_changes(lake, rows_of([(3, {"n": 3.5}), (4, {"n": 4})], 10), source_txn=("a", 2))
    proc = run_compact(lake, compact_env(CDCD_FAILPOINTS="lake.compact.table_merge"))
    _, err = proc.communicate(timeout=900)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    table = DeltaTable(str(path))
    assert table.version() == created + 1  # the rewrite alone
    assert table.transaction_version(COMPACT_APP_ID) == before and compacted_version(lake) == before
    cut = latest_cut(lake)
    assert cut is not None and cut.tables["orders"] == created
    check(
        lake,
        spark,
        "orders",
        {"n": "DOUBLE"},
        {1: ({"n": 1.0}, None), 2: ({"n": 1 << 60}, {"n": 1 << 60}), 3: ({"n": 3.0}, None)},
        cut=False,
    )

    result = compact(spark, lake)
    assert result.to_version == version and compacted_version(lake) == version
    assert DeltaTable(str(path)).transaction_version(COMPACT_APP_ID) == version
    want = {1: ({"n": 1.0}, None), 2: ({"n": 1 << 60}, {"n": 1 << 60}), 3: ({"n": 3.5}, None), 4: ({"n": 4.0}, None)}
    check(lake, spark, "orders", {"n": "DOUBLE"}, want)
    amount = next(c for c in next(iter(tables_show(lake))).columns if c.column == "n")
    assert [(w["from"], w["to"], w["version"]) for w in amount.widened] == [("BIGINT", "DOUBLE", created + 1)]


@pytest.mark.timeout(1200)
def test_datetimes_and_dates_a_node_holds_land_as_timestamp_and_date(spark: Any, tmp_path: Path) -> None:
    """Through a real node and the lake sink (the C row builder writes the changes table): aware datetimes, at
    UTC and at +02:00, are a TIMESTAMP column of their UTC instants; dates a DATE column; naive datetimes,
    whose zone nobody knows, a STRING of their text; a field of ints and doubles one DOUBLE column. Every reader
    reads the types, and every row rebuilds as the node's value as the lattice types it."""
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from cdcd.node import Node
    from tests.support.config import NO_MAINTENANCE
    from tests.support.delta_lake import wal_batch

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    values = {
        1: {"at": dt.datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=UTC), "day": dt.date(2026, 3, 1), "x": 1},
        2: {"at": dt.datetime(2026, 3, 1, 12, 0, tzinfo=PLUS_2), "day": dt.date(1999, 12, 31), "x": 2.5},
        3: {"at": dt.datetime(1, 1, 1, tzinfo=UTC), "naive": dt.datetime(2026, 1, 1, 8, 30), "x": 3},
    }
    with Node.open(node_dir) as node:
        node.cache("events").put_all(values)
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        assert sink.on_events(wal_batch(node_dir)) is True
    finally:
        sink.stop()
    compact(spark, lake)
    check(
        lake,
        spark,
        "events",
        {"at": "TIMESTAMP", "day": "DATE", "naive": "STRING", "x": "DOUBLE"},
        {
            1: ({"at": "2026-03-01T12:00:00.250000Z", "day": "2026-03-01", "x": 1.0}, None),
            2: ({"at": "2026-03-01T10:00:00Z", "day": "1999-12-31", "x": 2.5}, None),
            3: ({"at": "0001-01-01T00:00:00Z", "naive": "2026-01-01T08:30:00", "x": 3.0}, None),
        },
    )
    from cdcd.lake.reading.readers import duckdb_connect

    sql = (
        f"SELECT key FROM delta_scan('{table_dir(lake, 'events')}') WHERE \"at\" = TIMESTAMPTZ '2026-03-01 10:00:00+00'"
    )
    assert duckdb_connect().sql(sql).fetchall() == [(2,)]
    rows = spark.sql(f"SELECT key FROM delta.`{table_dir(lake, 'events')}` WHERE day < DATE'2000-01-01'").collect()
    assert [r["key"] for r in rows] == [2]
