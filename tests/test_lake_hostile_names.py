"""One bad field name, value or typed table never stops the lake (issue 47 items 1, 2, 7, 9, 10).

Each trigger the issue found lands in a lake beside a plain cache, and the lake is then compacted again: field
names with a backtick, a NUL or any other control character become columns (escaped, ``$xx``) through two
compactions (the second is a MERGE naming every column); values nested deeper than ``MAX_NESTING`` are kept in
``_rescued`` and a list nested 30 deep reads back in DuckDB at once; a typed table delta-rs cannot open and one
whose MERGE fails are named in one line and skipped while ``state`` and every other table stay current and exact
(the failed one rebuilt from ``state`` at the next compaction, the unreadable one once its directory is deleted),
with no traceback from ``cdcd lake compact``; a cache dropped and created again gets its types afresh whatever
the compaction timing; a lake sink starting on a ``changes`` table with a deleted data file stops with exit 8.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest

from cdcd.lake.maintenance.compact import compact
from cdcd.lake.table import CHANGE_SCHEMA
from cdcd.lake.typed.infer import (
    BAD_CHARS,
    KEY,
    MAX_NESTING,
    META_COLUMNS,
    RESCUED,
    Layout,
    column_name,
    convert,
    rebuild,
    type_of,
)
from cdcd.lake.typed.layout import list_tables, read_layout, scan_tables
from cdcd.lake.typed.layout import table_dir as lake_table_dir
from tests.support.delta_tables import append_changes, change, state_rows

CONTROLS = [chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]]
"""Every control character (C0, DEL, C1), NUL among them."""


def table_dir(lake: Path, cache: str) -> Path:
    path = lake_table_dir(lake, cache)
    assert isinstance(path, Path)
    return path


def nested(depth: int, leaf: object = 1, *, kind: str = "dict") -> object:
    value = leaf
    for _ in range(depth):
        value = {"x": value} if kind == "dict" else [value]
    return value


def canonical(value: object) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def fold(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(cache, key JSON) -> value JSON of the latest change per key, a ``truncate`` emptying its cache."""
    out: dict[tuple[str, str], str] = {}
    for row in sorted(rows, key=lambda r: (r["version_order"], r["wal_offset"])):
        if row["op"] == "truncate":
            out = {k: v for k, v in out.items() if k[0] != row["cache"]}
        elif row["op"] == "delete":
            out.pop((row["cache"], row["key"]), None)
        else:
            out[(row["cache"], row["key"])] = row["value"]
    return out


def typed_rows(path: Path, reader: str, spark: Any) -> list[dict[str, Any]]:
    if reader == "spark":
        return [r.asDict(recursive=True) for r in spark.read.format("delta").load(str(path)).collect()]
    if reader == "polars":
        import polars as pl

        return pl.read_delta(str(path)).to_dicts()
    if reader == "duckdb":
        from cdcd.lake.reading.readers import duckdb_connect

        sql = "SELECT * FROM delta_scan('" + str(path).replace("'", "''") + "')"
        return duckdb_connect().sql(sql).arrow().read_all().to_pylist()  # type: ignore[no-any-return]
    from deltalake import DeltaTable

    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()  # type: ignore[no-any-return]


def check_exact(
    lake: Path, expected: dict[tuple[str, str], str], caches: set[str], spark: Any, readers: list[str]
) -> None:
    """``state`` holds exactly ``expected``, and the typed table of each of ``caches``, read by each reader,
    rebuilds exactly its part of it (one row per key)."""
    assert state_rows(lake) == expected
    tables = list_tables(lake)
    for cache in caches:
        layout = read_layout(tables[cache])
        assert isinstance(tables[cache], Path)
        want = {k: canonical(msgspec.json.decode(v)) for (c, k), v in expected.items() if c == cache}
        for reader in readers:
            got: dict[str, bytes] = {}
            for row in typed_rows(table_dir(lake, cache), reader, spark):
                key_json = row[KEY] if layout.key_json else msgspec.json.encode(row[KEY]).decode()
                assert key_json not in got, f"{reader}: two rows for key {key_json} of {cache!r}"
                got[key_json] = canonical(rebuild(row, layout))
            assert got == want, (reader, cache)


# --- the rules, without Spark ---------------------------------------------------------------------------------
def test_every_control_character_and_the_backtick_are_escaped_in_column_names() -> None:
    """A field name with a backtick, NUL or any other control character gets a column name without any (each as
    ``$`` and two hex digits), unique, and a nested dict with such a key is no struct (it is rescued)."""
    taken: list[str] = []
    for c in [*CONTROLS, "`"]:
        name = column_name(f"a{c}b", taken)
        assert name == f"a${ord(c):02x}b" and not set(name) & BAD_CHARS, repr(name)
        taken.append(name)
    assert len({t.lower() for t in taken}) == len(taken)
    assert type_of({"a`b": 1}) is None and type_of({"a\x00b": 1}) is None and type_of({"ab": 1}) is not None


def test_values_nested_deeper_than_the_cap_are_rescued_exactly() -> None:
    """Lists and dicts up to ``MAX_NESTING`` deep are typed; one level more has no type, so such a value (up to
    the node's 256) goes to ``_rescued``, and the row rebuilds the value exactly."""
    for kind in ("dict", "list"):
        assert type_of(nested(MAX_NESTING, kind=kind)) is not None
        assert type_of(nested(MAX_NESTING + 1, kind=kind)) is None
    values = [{"d": nested(MAX_NESTING)}, {"d": nested(255, kind="list")}, {"d": nested(200)}, nested(256, kind="list")]
    rows = [change("c", str(i), msgspec.json.encode(v).decode(), i + 1) for i, v in enumerate(values)]
    columns = ["op", "key", "value", *(src for _, _, src in META_COLUMNS), "cache"]
    conv = convert(pa.Table.from_pylist(rows, schema=CHANGE_SCHEMA).select(columns), Layout())
    assert conv.rescued == 3
    for row, value in zip(conv.rows.to_pylist(), values, strict=True):
        assert canonical(rebuild(row, conv.layout)) == canonical(value)


# --- hostile names and deep values through two compactions ------------------------------------------------------
@pytest.mark.timeout(1200)
def test_hostile_field_names_and_deep_values_compact_twice_and_every_reader_reads_them(
    spark: Any, tmp_path: Path
) -> None:
    """Field names with a backtick, NUL and every control character, values nested 100 and 200 deep and a list
    nested 30 deep, beside a plain cache: both compactions skip no table, ``state`` and every table are exact
    (the second adds columns and MERGEs by name), every reader reads every table, and the deep list's table
    reads back in DuckDB in seconds (uncapped: minutes)."""
    lake = tmp_path / "lake"
    controls = {f"c{c}x": i for i, c in enumerate(CONTROLS)}
    first = [
        change("good", "1", '{"qty": 1}', 1),
        change("tick", "1", json.dumps({"a`b": 1, "n": 1}), 2),
        change("nul", "1", json.dumps({"a\x00b": 1}), 3),
        change("ctl", "1", json.dumps(controls), 4),
        change("deep", "1", json.dumps({"d": nested(100)}), 5),
        change("deep", "2", json.dumps({"l": nested(30, kind="list")}), 6),
        change("deep", "3", json.dumps({"d": nested(MAX_NESTING - 1), "l": nested(MAX_NESTING - 1, kind="list")}), 7),
    ]
    second = [
        change("good", "2", '{"qty": 2}', 10),
        change("tick", "1", json.dumps({"a`b": 2, "n": 2, "`": "new"}), 11),
        change("tick", "2", json.dumps({"a`b": 3}), 12),
        change("nul", "2", json.dumps({"a\x00b": 2, "\x00": 0}), 13),
        change("ctl", "2", json.dumps({k: v + 1 for k, v in controls.items()}), 14),
        change("deep", "4", json.dumps({"d": nested(200)}), 15),
        change("deep", "2", json.dumps({"l": nested(30, kind="list"), "d": nested(2)}), 16),
    ]
    caches = {"good", "tick", "nul", "ctl", "deep"}
    append_changes(lake, first, source_txn=("node-a", 1))
    r1 = compact(spark, lake)
    assert r1.skipped == [] and set(r1.tables) == caches
    check_exact(lake, fold(first), caches, spark, ["delta-rs"])
    append_changes(lake, second, source_txn=("node-a", 2))
    r2 = compact(spark, lake)
    assert r2.skipped == [] and set(r2.tables) == caches
    check_exact(lake, fold(first + second), caches, spark, ["delta-rs", "polars", "duckdb", "spark"])

    tick = {name: col for name, (col, _) in read_layout(table_dir(lake, "tick")).columns.items()}
    assert tick == {"a`b": "a$60b", "n": "n", "`": "$60"}
    deep = read_layout(table_dir(lake, "deep"))
    assert not deep.key_json and {name for name in deep.columns} == {"d", "l"}  # typed from key 3's values
    from cdcd.lake.reading.readers import duckdb_connect

    path = str(table_dir(lake, "deep"))
    started = time.monotonic()
    rows = duckdb_connect().sql(f"SELECT * FROM delta_scan('{path}')").fetchall()
    assert len(rows) == 4 and time.monotonic() - started < 20, time.monotonic() - started


# --- a table that cannot be opened, one whose MERGE fails -------------------------------------------------------
def make_unreadable(path: Path) -> None:
    """A typed table as an older cdcd left it with a value nested 50 deep: its newest commit's schema is too
    deep for delta-rs to parse (serde_json's recursion limit)."""
    from cdcd.lake.deltalog import LOG_DIR, read_commit

    log_dir = path / LOG_DIR
    newest = max(int(p.name[:20]) for p in log_dir.glob("*.json"))
    meta = next(a["metaData"] for v in range(newest, -1, -1) for a in read_commit(path, v) if "metaData" in a)
    schema = json.loads(meta["schemaString"])
    deep: Any = "long"
    for _ in range(50):
        deep = {"type": "struct", "fields": [{"name": "x", "type": deep, "nullable": True, "metadata": {}}]}
    schema["fields"].append({"name": "d", "type": deep, "nullable": True, "metadata": {}})
    meta = {**meta, "schemaString": json.dumps(schema)}
    (log_dir / f"{newest + 1:020d}.json").write_text(json.dumps({"metaData": meta}) + "\n")


@pytest.mark.timeout(1200)
def test_an_unreadable_table_and_a_failing_one_are_skipped_while_state_and_the_others_stay_current(
    spark: Any, tmp_path: Path
) -> None:
    """One typed table delta-rs cannot open (a schema too deep, as an older cdcd wrote it) and one whose MERGE
    fails (a data file cut short): ``cdcd lake compact`` names each in one ``skipped:`` line, exits 0 without a
    traceback, ``state`` and the other tables are current and exact, and the cut leaves both out. The next
    compaction rebuilds the failed table from ``state`` (its stale mark) and it is exact again; the unreadable one
    stays skipped until its directory is deleted, then it is rebuilt from ``state`` too."""
    from cdcd.lake.cuts import latest_cut
    from cdcd.lake.typed.tables import STALE_MARK
    from tests.support.cli import run_cli

    lake = tmp_path / "lake"
    first = [change(cache, str(i), f'{{"qty": {i}}}', 10 * n + i) for n, cache in enumerate("abc") for i in range(3)]
    append_changes(lake, first, source_txn=("node-a", 1))
    compact(spark, lake)
    make_unreadable(table_dir(lake, "b"))
    victim = next(table_dir(lake, "c").glob("*.parquet"))
    victim.write_bytes(victim.read_bytes()[:20])

    second = [change(cache, "9", f'{{"qty": 9, "new": "{cache}"}}', 100 + n) for n, cache in enumerate("abc")]
    # A key the cut file holds: the MERGE reads only files whose key range a changed key falls in.
    second.append(change("c", "1", '{"qty": 91}', 110))
    append_changes(lake, second, source_txn=("node-a", 2))
    res = run_cli("lake", "compact", "--lake", str(lake), "--spark-master", "local[1]")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    skipped = sorted(line for line in lines if line.startswith("skipped: "))
    assert len(skipped) == 2 and len(lines) == 3, res.stdout
    assert skipped[0].startswith(f"skipped: {table_dir(lake, 'b')}: typed table of cache b skipped: "), skipped
    assert "recursion limit" in skipped[0] or "nested" in skipped[0], skipped
    assert skipped[1].startswith(f"skipped: {table_dir(lake, 'c')}: typed table of cache c skipped: "), skipped
    assert "Traceback" not in res.stdout + res.stderr
    expected = fold(first + second)
    check_exact(lake, expected, {"a"}, spark, ["delta-rs"])
    cut = latest_cut(lake)
    assert cut is not None and set(cut.tables) == {"a"}
    assert (table_dir(lake, "c") / STALE_MARK).exists()
    assert [b.cache for b in scan_tables(lake).unreadable] == ["b"]
    shown = run_cli("lake", "show", "--lake", str(lake))
    assert shown.returncode == 0 and "Traceback" not in shown.stdout + shown.stderr, shown.stderr
    assert f"table b ({table_dir(lake, 'b')}): unreadable, skipped: " in shown.stdout, shown.stdout

    third = [change("a", "1", '{"qty": 11}', 200)]
    append_changes(lake, third, source_txn=("node-a", 3))
    r3 = compact(spark, lake)
    assert [b.cache for b in r3.skipped] == ["b"]
    expected = fold(first + second + third)
    check_exact(lake, expected, {"a", "c"}, spark, ["delta-rs"])
    assert not (table_dir(lake, "c") / STALE_MARK).exists()
    cut = latest_cut(lake)
    assert cut is not None and set(cut.tables) == {"a", "c"}

    # Scheduled maintenance, as a daemon runs it: runs go on with the unreadable table skipped, none fails.
    from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
    from tests.support.procs import wait_for

    maintainer = Maintainer(lake, spark, MaintainerOptions(compact_interval_s=0.2, optimize_interval_s=0))
    maintainer.start()
    try:
        append_changes(lake, [change("a", "2", '{"qty": 12}', 300)], source_txn=("node-a", 4))
        wait_for(lambda: maintainer.compactions >= 2 or not maintainer.alive(), 600, "two scheduled compactions")
    finally:
        maintainer.stop()
    assert maintainer.alive() and maintainer.failures == 0, maintainer.last_failure
    assert maintainer.last_compact is not None and [b.cache for b in maintainer.last_compact.skipped] == ["b"]
    expected = fold(first + second + third + [change("a", "2", '{"qty": 12}', 300)])
    check_exact(lake, expected, {"a", "c"}, spark, ["delta-rs"])

    import shutil

    shutil.rmtree(table_dir(lake, "b"))
    r4 = compact(spark, lake)  # nothing new: the table comes from state
    assert r4.skipped == [] and set(r4.tables) == {"a", "b", "c"}
    check_exact(lake, expected, {"a", "b", "c"}, spark, ["delta-rs"])
    cut = latest_cut(lake)
    assert cut is not None and set(cut.tables) == {"a", "b", "c"}


# --- a cache dropped and created again ---------------------------------------------------------------------------
def dropped(cache: str, version: int) -> dict[str, Any]:
    return {**change(cache, "", None, version, op="truncate"), "key": None}


def schema_of(path: Path) -> dict[str, str]:
    from deltalake import DeltaTable

    return {f.name: str(f.type) for f in DeltaTable(str(path)).schema().fields}


@pytest.mark.timeout(1200)
def test_a_cache_dropped_and_created_again_gets_new_types_whatever_the_compaction_timing(
    spark: Any, tmp_path: Path
) -> None:
    """A cache with int keys and BIGINT ``qty`` is dropped and created again with string keys and string ``qty``:
    the drop and the new rows in one compaction after the first, or the drop in one and the new rows in the next,
    give the table the same schema as one compaction of the whole history (STRING key and ``qty``, typed keys),
    nothing rescued, every row exact; the other cache's table is untouched by it and exact."""
    v1 = [change("shape", str(i), f'{{"qty": {i}}}', 1 + i) for i in range(3)] + [change("other", "1", '{"n": 1}', 9)]
    v2 = [change("shape", json.dumps(f"k{i}"), json.dumps({"qty": f"q{i}", "sku": "s"}), 20 + i) for i in range(7)]
    timings = {
        "together": [[*v1, dropped("shape", 10), *v2]],
        "one range": [v1, [dropped("shape", 10), *v2]],
        "two ranges": [v1, [dropped("shape", 10)], v2],
    }
    schemas = {}
    for name, ranges in timings.items():
        lake = tmp_path / name.replace(" ", "-")
        for n, rows in enumerate(ranges):
            append_changes(lake, rows, source_txn=("node-a", n + 1))
            assert compact(spark, lake).skipped == []
        history = [r for rows in ranges for r in rows]
        check_exact(lake, fold(history), {"shape", "other"}, spark, ["delta-rs"])
        from deltalake import DeltaTable

        rescued = DeltaTable(str(table_dir(lake, "shape"))).to_pyarrow_table(columns=[RESCUED]).column(0)
        assert rescued.null_count == len(rescued) == 7, name
        schemas[name] = schema_of(table_dir(lake, "shape"))
        assert not read_layout(table_dir(lake, "shape")).key_json, name
    assert schemas["together"]["qty"] == schemas["together"]["key"] == 'PrimitiveType("string")'
    assert schemas["one range"] == schemas["two ranges"] == schemas["together"]


# --- a deleted data file under changes at the daemon's start ----------------------------------------------------
def landed_lake(tmp: Path) -> tuple[Path, Path]:
    """A node's WAL landed by the real sink in four commits, a checkpoint of ``changes`` after the second."""
    from deltalake import DeltaTable

    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from tests.support.config import NO_MAINTENANCE
    from tests.support.delta_lake import sub_batch, wal_batch
    from tests.support.writer import make_node

    node_dir, lake = tmp / "node", tmp / "lake"
    make_node(node_dir, segments=2, tx_per_segment=20)
    batch = wal_batch(node_dir)
    n = len(batch.peek_slices())
    per = -(-n // 4)
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        for k in range(0, n, per):
            assert sink.on_events(sub_batch(batch, k, k + per)) is True
            if k == per:
                DeltaTable(str(lake / "changes")).create_checkpoint()
    finally:
        sink.stop()
    return node_dir, lake


def data_files(lake: Path, version: int) -> list[Path]:
    """The data files commit ``version`` of ``changes`` added."""
    from urllib.parse import unquote

    from cdcd.lake.deltalog import read_commit

    return [lake / "changes" / unquote(a["add"]["path"]) for a in read_commit(lake / "changes", version) if "add" in a]


def test_a_daemon_starting_on_changes_with_a_deleted_or_cut_data_file_stops_with_exit_8(tmp_path: Path) -> None:
    """A data file the last checkpoint names deleted: ``cdcd run`` exits 8 (as ``lake compact``/``verify``/``check``
    stop) with one error line naming the file and no traceback, and lands nothing; a file of a commit after the
    checkpoint cut short: the sink's start names it and both sizes."""
    from cdcd.lake.reading.check import EXIT_DAMAGED_LAKE, DamagedLake
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from tests.support.config import NO_MAINTENANCE
    from tests.support.delta_lake import lake_consumer
    from tests.support.lake import write_config
    from tests.support.procs import error_lines, reap, start_daemon

    node_dir, lake = landed_lake(tmp_path)
    log_files = sorted(p.name for p in (lake / "changes" / "_delta_log").iterdir())
    gone = data_files(lake, 1)[0]
    gone.unlink()
    config = write_config(tmp_path / "daemon.toml", node_dir, lake_consumer(lake))
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        rc = proc.wait(120)
    finally:
        reap(proc)
    lines = error_lines(err)
    assert rc == EXIT_DAMAGED_LAKE and len(lines) == 1, err.read_text()[-3000:]
    assert f"{gone}: named by the log but missing" in lines[0], lines
    assert "Traceback" not in err.read_text()
    assert sorted(p.name for p in (lake / "changes" / "_delta_log").iterdir()) == log_files

    gone.write_bytes(b"")  # back, but empty: the log's size no longer matches
    cut = data_files(lake, 4)[0]
    cut.write_bytes(cut.read_bytes()[:-1])
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    with pytest.raises(DamagedLake) as info:
        sink.start()
    sink.stop()
    assert "\n" not in str(info.value) and "1 more: `cdcd lake check`" in str(info.value)
    first = min(str(gone), str(cut))
    assert str(info.value).startswith(f"{first}: ") and "bytes where the log records" in str(info.value)


def test_the_start_check_of_changes_data_files_on_an_object_store(tmp_path: Path) -> None:
    """The same check on ``s3://`` (MinIO on loopback: one listing, no file read): a whole table passes; a
    deleted object and one cut short are each named, the first with how many more."""
    from cdcd.lake.maintenance.feed import require_live_files
    from cdcd.lake.reading.check import DamagedLake
    from cdcd.lake.storage import StorageOptions, lake_root, open_delta
    from cdcd.lake.table import CHANGES, CHANGES_PROPERTIES, PARTITION_BY
    from tests.support.servers import MINIO_BIN, MINIO_PASSWORD, MINIO_USER, MinioServer

    if not MINIO_BIN.exists():
        pytest.skip("MinIO not built: run make install")
    server = MinioServer(tmp_path / "minio")
    server.start()
    try:
        server.create_bucket("lake")
        storage = StorageOptions(
            endpoint=server.endpoint, path_style=True, access_key_id=MINIO_USER, secret_access_key=MINIO_PASSWORD
        )
        changes = lake_root("s3://lake/l", storage) / CHANGES
        from deltalake import write_deltalake

        for n, cache in enumerate(["orders", "odd name/é%"]):
            rows = pa.Table.from_pylist([change(cache, str(n), '{"a": 1}', n + 1)], schema=CHANGE_SCHEMA)
            write_deltalake(
                str(changes),
                rows,
                mode="append",
                partition_by=list(PARTITION_BY),
                configuration=CHANGES_PROPERTIES,
                storage_options=changes.storage_options,  # type: ignore[union-attr]
            )
        require_live_files(changes, open_delta(changes))
        adds = open_delta(changes).get_add_actions(flatten=True).column("path").to_pylist()
        from urllib.parse import unquote

        objects = sorted((changes / unquote(str(p)) for p in adds), key=str)
        objects[0].fs.delete_file(objects[0].fs_path)  # type: ignore[union-attr]
        with objects[1].fs.open_output_stream(objects[1].fs_path) as out:  # type: ignore[union-attr]
            out.write(b"short")
        with pytest.raises(DamagedLake) as info:
            require_live_files(changes, open_delta(changes))
        assert str(info.value).startswith(f"{objects[0]}: named by the log but missing: "), str(info.value)
        assert "(1 more: `cdcd lake check`)" in str(info.value)
        objects[0].write_bytes(b"")
        with pytest.raises(DamagedLake, match="bytes where the log records"):
            require_live_files(changes, open_delta(changes))
    finally:
        server.stop()
