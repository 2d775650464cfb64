"""The typed tables ``<lake>/tables/<cache>`` (issue 27 §1, §4): types inferred from the values, schema
evolution, misfits kept in ``_rescued``, odd cache and field names, declared types; read by Spark,
delta-rs, polars and DuckDB; every live value rebuilt from the typed columns equals the node's; a resent
cache gives no duplicate keys; a cache created while the sink runs gets its table at the next compaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.lake.maintenance.compact import compact
from cdcd.lake.table import CHANGE_SCHEMA
from cdcd.lake.typed.declared import DeclaredSchemaError, load_declared
from cdcd.lake.typed.infer import (
    BAD_CHARS,
    KEY,
    META_COLUMNS,
    NON_DICT,
    NULLS,
    RESCUED,
    TIMESTAMP,
    Layout,
    checker,
    choose_type,
    convert,
    fits_value,
    rebuild,
    top_checker,
)
from cdcd.lake.typed.layout import CACHE_PROPERTY, NotATypedTable, list_tables, read_layout, table_dir
from cdcd.lake.typed.show import tables_show
from tests.support.delta_tables import append_changes, change, expected_state
from tests.support.procs import wait_for

ODD_FIELDS = ["qty", "Qty", "a.b", "my field", "x=y", "", "key", "value", "_hidden", "$", "f" * 255, "(p)", "t\tab"]
"""Field names a column cannot have as they are (and some it can)."""
DEADLINE_S = 900.0
"""Scheduled compactions on a loaded 2-core machine (three JVMs at load 40: over 300 s for the first)."""


def canonical(value: object) -> bytes:
    """JSON with sorted keys: 1, 1.0 and true stay three different values (Python's == does not)."""
    return msgspec.json.encode(value, order="sorted")


def as_typed(value: object, layout: Layout) -> object:
    """The node's value as its typed row gives it back (docs/lake.md, the lattice): an int in a double is that
    double, a scalar in a string column its JSON text, a date in a timestamp column its midnight; a value its
    column does not take comes back as it is (from ``_rescued``)."""
    if type(value) is dict:
        return {k: _as_column(layout.columns.get(k), x, layout) for k, x in value.items()}
    return _as_column(layout.columns.get(NON_DICT), value, layout)


def _as_column(column: tuple[str, pa.DataType] | None, x: object, layout: Layout) -> object:
    if column is None or x is None or column[0] in {layout.columns[f][0] for f in layout.json_fields}:
        return x
    t = column[1]
    if not top_checker(t)(x):
        return x
    if t == pa.string():
        return x if type(x) is str else msgspec.json.encode(x).decode()
    if t == TIMESTAMP and len(str(x)) == 10:
        return f"{x}T00:00:00Z"
    return _as_type(t, x)


def _as_type(t: pa.DataType, x: object) -> object:
    if x is None:
        return None
    if t == pa.float64():
        return float(x)  # type: ignore[arg-type]
    if pa.types.is_list(t):
        return [_as_type(t.value_type, e) for e in x]  # type: ignore[attr-defined]
    if pa.types.is_struct(t):
        return {k: _as_type(t.field(k).type, e) for k, e in x.items()}  # type: ignore[attr-defined]
    return x


# --- the rules, without Spark ------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["x", "y", "Y", "a b", ""]), inner, max_size=3)
    ),
    max_leaves=6,
)
dict_values = st.dictionaries(st.sampled_from(ODD_FIELDS), json_values, max_size=5)
keys = st.one_of(st.integers(0, 6), st.sampled_from(["0", "1", "5", "a"]))
"""Int and string keys that print alike (5 and "5") must never share a row."""
batches = st.lists(
    st.lists(
        st.tuples(keys, st.one_of(dict_values, dict_values, json_values, st.just(None).map(lambda _: "DEL"))),
        min_size=1,
        max_size=8,
    ),
    min_size=1,
    max_size=4,
)


def feed(batch: list[tuple[object, object]], first_version: int) -> pa.Table:
    """One cache's winners: the last change per key of ``batch`` (JSON text, as the changes table holds them)."""
    latest: dict[bytes, tuple[int, object, object]] = {}
    for i, (k, v) in enumerate(batch):
        latest[msgspec.json.encode(k)] = (first_version + i, k, v)
    rows = []
    for key_json, (version, _, v) in latest.items():
        value = None if v == "DEL" else msgspec.json.encode(v).decode()
        rows.append(change("c", key_json.decode(), value, version))
    columns = ["op", "key", "value", *(src for _, _, src in META_COLUMNS), "cache"]
    return pa.Table.from_pylist(rows, schema=CHANGE_SCHEMA).select(columns)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_every_value_shape_round_trips_through_the_typed_columns(batches: list[list[tuple[object, object]]]) -> None:
    """Batches of evolving, conflicting, nested values with odd field names, folded as compaction folds them
    (a later batch replaces a key's row; keys of a second type rebuild all rows with JSON keys): every live
    value rebuilt from its typed columns, ``_nulls`` and ``_rescued`` equals the value written as the lattice
    types it (``as_typed``: ints that doubles hold exactly as doubles, scalars in a string column as their
    text; the rest exactly), and every column name is one Parquet and Delta take without column mapping,
    unique ignoring case."""
    layout = Layout()
    table: dict[bytes, dict[str, object]] = {}
    node: dict[bytes, object] = {}
    version = 1
    for batch in batches:
        before = dict(node)
        for k, v in batch:
            if v == "DEL":
                node.pop(msgspec.json.encode(k), None)
            else:
                node[msgspec.json.encode(k)] = v
        rows = feed(batch, version)
        version += len(batch)
        conv = convert(rows, layout)
        if conv.key_changed or conv.widened:
            # As compaction does: the table rebuilt with JSON keys, or wider columns, from state (what the
            # node held before this batch), then the batch converted again with that layout.
            assert not conv.key_changed or (not layout.key_json and conv.layout.key_json)
            again = convert(feed([(msgspec.json.decode(k), v) for k, v in before.items()], 0), conv.layout)
            table = {row[KEY].encode(): row for row in again.rows.to_pylist()}
            conv = convert(rows, again.layout)
            assert not conv.key_changed and not conv.widened
        layout = conv.layout
        for row in conv.rows.to_pylist():
            key_json = row[KEY].encode() if layout.key_json else msgspec.json.encode(row[KEY])
            if row["_op"] == "delete":
                table.pop(key_json, None)
            else:
                table[key_json] = row
    assert set(table) == set(node)
    for key_json, row in table.items():
        assert canonical(rebuild(row, layout)) == canonical(as_typed(node[key_json], layout)), key_json
    names = [c for c, _ in layout.columns.values()]
    assert len({n.lower() for n in names}) == len(names)
    for name in names:
        assert name and not (set(name) & BAD_CHARS) and not name.startswith("_") and name.lower() != KEY


@settings(max_examples=500, deadline=None)
@given(json_values, json_values)
def test_the_fast_fit_check_agrees_with_the_type_rules(a: object, b: object) -> None:
    """``checker`` (Python types only, the hot path) answers as ``fits_value(type, value)`` does."""
    t = choose_type([a])
    if t is None or b is None:
        return
    assert checker(t)(b) == fits_value(t, b), (t, b)


def test_a_declared_schema_with_an_unknown_type_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "tables.toml"
    config.write_text('[tables.orders]\ncolumns = { qty = "int64", sku = "varchar" }\n')
    with pytest.raises(DeclaredSchemaError, match=r"tables\.toml: tables\.orders\.columns\.sku = 'varchar': unknown"):
        load_declared(config)
    config.write_text('[consumer]\nkind = "lake"\n[consumer.tables.orders]\ncolumns = { qty = "int64" }\n')
    assert dict(load_declared(config)["orders"].columns) == {"qty": "int64"}


# --- Spark compaction, four readers ----------------------------------------------------------------------------
def typed_rows(path: Path, reader: str, spark: Any) -> list[dict[str, Any]]:
    if reader == "spark":
        return [r.asDict(recursive=True) for r in spark.read.format("delta").load(str(path)).collect()]
    if reader == "delta-rs":
        from deltalake import DeltaTable

        return DeltaTable(str(path)).to_pyarrow_table().to_pylist()  # type: ignore[no-any-return]
    if reader == "polars":
        import polars as pl

        return pl.read_delta(str(path)).to_dicts()
    from cdcd.lake.reading.readers import duckdb_connect

    sql = "SELECT * FROM delta_scan('" + str(path).replace("'", "''") + "')"
    return duckdb_connect().sql(sql).arrow().read_all().to_pylist()  # type: ignore[no-any-return]


def check_tables(lake: Path, expected: dict[tuple[str, str], str], spark: Any, readers: list[str]) -> None:
    """Every typed table, read by each reader, rebuilds exactly ``expected`` ((cache, key JSON) -> value JSON) as
    the lattice types it."""
    tables = list_tables(lake)
    assert set(tables) == {cache for cache, _ in expected}
    for cache, path in tables.items():
        layout = read_layout(path)
        want = {k: msgspec.json.decode(v) for (c, k), v in expected.items() if c == cache}
        for reader in readers:
            got: dict[str, object] = {}
            for row in typed_rows(path, reader, spark):
                key_json = row[KEY] if layout.key_json else msgspec.json.encode(row[KEY]).decode()
                assert key_json not in got, f"{reader}: two rows for key {key_json} of {cache!r}"
                got[key_json] = rebuild(row, layout)
            assert {k: canonical(v) for k, v in got.items()} == {
                k: canonical(as_typed(v, layout)) for k, v in want.items()
            }, (
                reader,
                cache,
            )


ODD_CACHE = "odd cache=x.y " + "é" * 20
"""(The node test lands a 217-character name through cdcd's own writer; this helper's writer escapes the directory.)"""


@pytest.mark.timeout(1800)  # several compactions and JVM starts: minutes on a loaded 2-core machine
def test_compaction_types_evolves_rescues_and_every_reader_reads_it(spark: Any, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    first = [
        change("orders", "1", '{"qty": 1, "sku": "a", "price": 1.5, "tags": ["x"], "dims": {"w": 1, "h": 2}}', 1),
        change("orders", "2", '{"qty": 2, "sku": "b", "price": 2.5, "tags": [], "dims": {"w": 3, "h": 4}}', 2),
        change("orders", "3", '{"qty": 3, "sku": "c", "note": null}', 3),
        change(ODD_CACHE, '"5"', '{"my field": 1, "Qty": true, "qty": "lower", "": 0, "key": "k", "_x": 1}', 4),
        change(ODD_CACHE, "5", '"an int key, a string value"', 5),
        change("plain", '"a"', "7", 6),
        change("plain", '"b"', "[1, 2]", 7),
    ]
    second = [
        # a new field; an int column meeting a dict; a struct with other keys; a delete; a new key
        change("orders", "1", '{"qty": {"many": true}, "sku": "a", "colour": "red", "dims": {"w": 1}}', 10),
        change("orders", "2", None, 11),
        change("orders", "4", '{"qty": 4, "sku": "d", "colour": "blue", "price": 4}', 12),
        change(ODD_CACHE, '"5"', '{"my field": 2, "Qty": false}', 13),
        change("plain", '"a"', '{"now": "a dict"}', 14),
        change("plain", "7", "8", 15),  # an int key in a string-keyed cache: the key becomes JSON text
    ]
    append_changes(lake, first, source_txn=("node-a", 1))
    r1 = compact(spark, lake)
    assert set(r1.tables) == {"orders", ODD_CACHE, "plain"}
    check_tables(lake, expected_state(first), spark, ["spark", "delta-rs"])
    append_changes(lake, second, source_txn=("node-a", 2))
    r2 = compact(spark, lake)
    assert r2.rescued >= 2, r2
    check_tables(lake, expected_state(first + second), spark, ["spark", "delta-rs", "polars", "duckdb"])

    from deltalake import DeltaTable

    orders = DeltaTable(str(lake / "tables" / "orders"))
    assert orders.metadata().configuration[CACHE_PROPERTY] == "orders"
    assert orders.metadata().configuration["delta.enableChangeDataFeed"] == "true"
    protocol = orders.protocol()
    features = set(protocol.reader_features or []) | set(protocol.writer_features or [])
    assert not features & {"columnMapping", "deletionVectors", "v2Checkpoint", "rowTracking", "typeWidening"}
    assert [h["operation"] for h in reversed(orders.history())].count("ADD COLUMN") == 1  # colour
    schema = {f.name: str(f.type) for f in orders.schema().fields}
    assert schema["qty"] == 'PrimitiveType("long")' and schema["price"] == 'PrimitiveType("double")'
    odd = DeltaTable(str(table_dir(lake, ODD_CACHE)))
    assert odd.metadata().configuration[CACHE_PROPERTY] == ODD_CACHE
    assert read_layout(table_dir(lake, ODD_CACHE)).key_json  # "5" and 5 both held: JSON text keys
    assert read_layout(lake / "tables" / "plain").key_json

    # The typed aggregate a data engineer writes, in Spark SQL and DuckDB.
    path = str(lake / "tables" / "orders")
    total = spark.sql(f"SELECT sum(qty) AS n FROM delta.`{path}`").collect()[0]["n"]
    assert total == 3 + 4  # key 1's {"many": true} is rescued, key 2 deleted
    from cdcd.lake.reading.readers import duckdb_connect

    assert duckdb_connect().sql(f"SELECT sum(qty) FROM delta_scan('{path}')").fetchone() == (7,)
    rescued = spark.sql(f"SELECT key, {RESCUED} FROM delta.`{path}` WHERE {RESCUED} IS NOT NULL ORDER BY key").collect()
    assert [(r["key"], msgspec.json.decode(r[RESCUED])) for r in rescued] == [
        (1, {"qty": {"many": True}, "dims": {"w": 1}}),
    ]
    price = spark.sql(f"SELECT price FROM delta.`{path}` WHERE key = 4").collect()[0]["price"]
    assert type(price) is float and price == 4.0  # an int in a double column is that double
    nulls = spark.sql(f"SELECT {NULLS} FROM delta.`{path}` WHERE key = 3").collect()
    assert nulls[0][NULLS] == ["note"]

    shows = {s.cache: s for s in tables_show(lake)}
    assert shows["orders"].rescued_rows == 1 and shows["orders"].key == "typed"
    colour = next(c for c in shows["orders"].columns if c.column == "colour")
    assert colour.since_version is not None and colour.since_version > 0

    # Typed changes per cache: the change data feed of the table, and the SCD type 2 example of docs/lake.md.
    cdf = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(path)
    kinds = {r["_change_type"] for r in cdf.select("_change_type").collect()}
    assert {"insert", "update_postimage", "delete"} <= kinds
    history = scd2(spark, path)
    assert [(r["key"], r["qty"], r["is_current"]) for r in history if r["key"] in (1, 2)] == [
        (1, 1, False),
        (1, None, True),
        (2, 2, False),
    ]


def scd2(spark: Any, path: str) -> list[Any]:
    """The SCD type 2 example of docs/lake.md, run as it is written there (its table path replaced)."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "lake.md").read_text()
    section = doc[doc.index("**Typed changes and an SCD type 2 history.**") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]
    scope: dict[str, Any] = {"spark": spark}
    exec(code.replace("/data/lake/tables/orders", path), scope)
    return scope["history"].orderBy("key", "valid_from").collect()  # type: ignore[no-any-return]


def test_a_directory_under_tables_that_is_not_a_delta_table_stops_compaction(spark: Any, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    append_changes(lake, [change("orders", "1", '{"qty": 1}', 1)], source_txn=("node-a", 1))
    stray = lake / "tables" / "stray"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("not a table")
    with pytest.raises(NotATypedTable, match=r"tables/stray: not a Delta table") as err:
        compact(spark, lake)
    assert "\n" not in str(err.value)
    assert not (lake / "state").exists() and not (lake / "tables" / "orders").exists()


# --- against a node: round trip, resend, a cache created while the sink runs -----------------------------------
def check_against_node(lake: Path, node_dir: Path, spark: Any) -> int:
    """Entry by entry: every live entry of every cache of the node is one row of its cache's typed table,
    and the value rebuilt from that row equals the node's; no other rows. Returns the entries checked."""
    from cdcd.node import Node

    with Node.open(node_dir) as node:
        want = {
            name: {msgspec.json.encode(k).decode(): v for k, v in node.cache(name).items()} for name in node.caches()
        }
    tables = list_tables(lake)
    assert set(tables) == {name for name, entries in want.items() if entries}
    checked = 0
    for cache, path in tables.items():
        layout = read_layout(path)
        seen: set[str] = set()
        for row in typed_rows(path, "spark", spark):
            key_json = row[KEY] if layout.key_json else msgspec.json.encode(row[KEY]).decode()
            assert key_json not in seen, f"two rows for key {key_json} of {cache!r}"
            seen.add(key_json)
            assert key_json in want[cache], f"{cache!r}: row for {key_json}, which the node does not hold"
            assert canonical(rebuild(row, layout)) == canonical(want[cache][key_json]), (cache, key_json)
            checked += 1
        assert seen == set(want[cache]), cache
    return checked


@pytest.mark.timeout(1800)  # several compactions and JVM starts: minutes on a loaded 2-core machine
def test_node_values_round_trip_a_resent_cache_and_a_new_cache_arrive_on_schedule(spark: Any, tmp_path: Path) -> None:
    """The lake sink (JVM-free writer) with scheduled compaction, fed a node's WAL: every table equals the
    node entry by entry; then, without restarting the sink, a cache is created and another one resent
    into the lake that already holds it, with writes after the resend: the new cache is a table after
    the next compaction, the resent one has no duplicate keys and the newest version of each key."""
    from cdcd.config import convert as convert_options
    from cdcd.lake.maintenance.compact import compacted_version, table_version
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from cdcd.node import Node
    from tests.support.delta_lake import wal_batch

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    with Node.open(node_dir) as node:
        node.cache("orders").put_all(
            {i: {"qty": i, "sku": f"s{i}", "price": i / 4, "tags": ["a"] * (i % 3)} for i in range(200)}
        )
        node.cache("orders").put(7, {"qty": "seven", "sku": None, "blob": b"\x00\x01"})
        odd = node.cache("odd name 1.2 (é) " + "x" * 200)
        odd.put_all({"5": {"my field": 1, "Qty": 2, "qty": 3}, 5: "an int key", "k": [1, {"a": None}]})
    tables = {"orders": {"columns": {"qty": "int64", "note": "json"}}}
    opts = convert_options(
        {
            "lake_path": str(lake),
            "writer": "deltalake",
            "spark_master": "local[2]",
            "compact_interval_s": 0.5,
            "optimize_interval_s": 0,
            "tables": tables,
        },
        LakeOptions,
        "consumer",
    )
    sink = LakeConsumer(opts)
    sink.start()
    try:
        assert sink.on_events(wal_batch(node_dir)) is True
        version = table_version(lake / "changes")
        wait_for(lambda: compacted_version(lake) == version, DEADLINE_S, "the scheduled compaction")
        assert check_against_node(lake, node_dir, spark) == 203
        orders_layout = read_layout(lake / "tables" / "orders")
        assert orders_layout.columns["note"][1] == pa.string() and "note" in orders_layout.json_fields

        with Node.open(node_dir) as node:
            late = node.cache("late")  # created while the sink runs
            late.put_all({f"k{i}": {"n": i, "new": i % 2 == 0} for i in range(50)})
            orders = node.cache("orders")
            orders.put(1, {"qty": 100, "sku": "after", "note": {"free": ["form"]}})
            orders.remove(2)
            assert node.resend("orders") == 199
            orders.put(3, {"qty": 300, "sku": "after the resend", "colour": "red"})
        assert sink.on_events(wal_batch(node_dir)) is True
        version = table_version(lake / "changes")
        wait_for(lambda: compacted_version(lake) == version, DEADLINE_S, "the next scheduled compaction")
        assert "late" in list_tables(lake)
        assert check_against_node(lake, node_dir, spark) == 199 + 3 + 50
    finally:
        sink.stop()


@pytest.mark.timeout(1800)  # several compactions and JVM starts: minutes on a loaded 2-core machine
def test_compaction_killed_between_the_tables_and_state_redoes_only_state(spark: Any, tmp_path: Path) -> None:
    """SIGKILL of `cdcd lake compact` once every typed table has committed the range and `state` has not:
    `state` is untouched, and the next compaction commits `state` and skips the tables (their own
    application transaction covers the range), which hold exactly the latest value per key."""
    import signal

    from cdcd.lake.maintenance.compact import compacted_version
    from tests.support.compaction import compact_env, kill_group, run_compact

    lake = tmp_path / "lake"
    first = [change("orders", str(i), f'{{"qty": {i}}}', i + 1) for i in range(20)]
    first += [change("x=y", f'"k{i}"', f'{{"a b": {i}}}', 100 + i) for i in range(5)]
    append_changes(lake, first, source_txn=("node-a", 1))
    compact(spark, lake)
    second = [change("orders", str(i), f'{{"qty": {i * 10}, "new": "n"}}', 200 + i) for i in range(0, 20, 2)]
    second += [change("orders", "1", None, 300), change("x=y", '"k9"', '{"a b": 9}', 301)]
    version = append_changes(lake, second, source_txn=("node-a", 2))
    proc = run_compact(lake, compact_env(CDCD_FAILPOINTS="lake.compact.tables_committed"))
    _, err = proc.communicate(timeout=900)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert compacted_version(lake) == version - 1
    from deltalake import DeltaTable

    from cdcd.lake.maintenance.compact import COMPACT_APP_ID

    for path in list_tables(lake).values():
        assert DeltaTable(str(path)).transaction_version(COMPACT_APP_ID) == version, path
    versions = {cache: table_version_of(path) for cache, path in list_tables(lake).items()}
    result = compact(spark, lake)
    assert result.to_version == version and compacted_version(lake) == version
    assert {cache: table_version_of(path) for cache, path in list_tables(lake).items()} == versions
    check_tables(lake, expected_state(first + second), spark, ["delta-rs"])


def table_version_of(path: Path) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(str(path)).version())


def test_a_node_re_created_in_a_fresh_dir_wins_in_the_typed_tables_as_in_state(spark: Any, tmp_path: Path) -> None:
    """A node writes its keys many times, the lake lands and compacts them; the node is re-created in a fresh
    dir (its order restarts low, its topology version grows) and writes the keys again, removing some. After
    the next compaction the typed table, like ``state``, holds the re-created node's value of every key
    (Ignite's version order, ``table.ORDER_COLUMNS``), entry by entry equal to the node: none of the old
    node's values, whose ``order`` is higher, and no removed key. The table, as an older cdcd compacted it
    (without the order's columns), is rebuilt once from ``state`` first."""
    import shutil

    from deltalake import DeltaTable

    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from cdcd.lake.storage import spark_path
    from cdcd.lake.typed.layout import schema_info
    from cdcd.node import Node
    from tests.support.delta_lake import wal_batch
    from tests.support.delta_tables import state_rows

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    sink = LakeConsumer(
        LakeOptions(lake_path=str(lake), writer="deltalake", compact_interval_s=0.0, optimize_interval_s=0.0)
    )
    sink.start()
    try:
        with Node.open(node_dir) as node:
            for j in range(10):
                node.cache("orders").put_all({i: {"qty": j, "by": "old"} for i in range(20)})
        assert sink.on_events(wal_batch(node_dir, "old-node")) is True
        compact(spark, lake)
        assert check_against_node(lake, node_dir, spark) == 20
        # As an older cdcd left it (``_version`` its one order column): rebuilt once from state below.
        path = spark_path(lake / "tables" / "orders")
        older = spark.read.format("delta").load(path).drop("_topology_version", "_node_order")
        older.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)
        assert "_node_order" not in {c.name for c in schema_info(DeltaTable(path))}
        shutil.rmtree(node_dir)
        with Node.open(node_dir) as node:
            node.cache("orders").put_all({i: {"qty": 100 + i, "by": "new"} for i in range(20)})
            for i in range(0, 20, 5):
                node.cache("orders").remove(i)
            want = {msgspec.json.encode(k).decode(): v for k, v in node.cache("orders").items()}
        assert sink.on_events(wal_batch(node_dir, "new-node")) is True
    finally:
        sink.stop()
    compact(spark, lake)
    assert {"_topology_version", "_node_order"} <= {c.name for c in schema_info(DeltaTable(path))}
    assert check_against_node(lake, node_dir, spark) == 16
    state = {key: msgspec.json.decode(value) for (cache, key), value in state_rows(lake).items() if cache == "orders"}
    assert {k: canonical(v) for k, v in state.items()} == {k: canonical(v) for k, v in want.items()}
