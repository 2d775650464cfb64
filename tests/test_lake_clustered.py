"""Key-range clustered ``state`` and typed tables (cdcd/lake/maintenance/clustered.py): a compaction rewrites
only the files whose key range its changed keys fall in.

Asserted on the Delta log's ``remove`` actions: a run of changes in one key range removes exactly the files
whose range overlaps it (``state``'s one commit; a typed table's MERGE and its clustering commit); keys before,
between and beyond the files' ranges go into the neighbouring file; an oversized file splits; deletes; the
small-file bound counts key-disjoint files as one sorted run and holds at every version; delta-rs, polars
and DuckDB read the same rows; a compaction SIGKILLed anywhere converges.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdcd.lake.maintenance.autocompact import FilePolicy, bound_compacted, sorted_runs_per_partition
from cdcd.lake.maintenance.clustered import FILE_ROWS, ranged_files
from cdcd.lake.maintenance.compact import compact, compacted_version
from cdcd.lake.table import STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import child_env

ROWS = 50
"""Rows per clustered file in these tests."""


def files(table: Path, *, cache: str | None = None) -> dict[str, tuple[Any, Any, int]]:
    """Live files of a table (of one cache partition of ``state``): path -> (min key, max key, rows)."""
    adds = pa.table(DeltaTable(str(table)).get_add_actions(flatten=True))
    if cache is not None:
        adds = adds.filter(pa.compute.equal(adds.column("partition.cache"), cache))
    return {f.path: (f.lo, f.hi, f.rows) for f in ranged_files(adds, "key")}


def removed_since(table: Path, version: int) -> set[str]:
    """Paths the commits after ``version`` removed."""
    out: set[str] = set()
    for v in range(version + 1, DeltaTable(str(table)).version() + 1):
        for line in (table / "_delta_log" / f"{v:020d}.json").read_text().splitlines():
            action = json.loads(line)
            if "remove" in action:
                out.add(action["remove"]["path"])
    return out


def overlapping(live: dict[str, tuple[Any, Any, int]], lo: Any, hi: Any) -> set[str]:
    return {p for p, (a, b, _) in live.items() if a <= hi and b >= lo}


def assert_disjoint(live: dict[str, tuple[Any, Any, int]], rows: int = ROWS) -> None:
    ranges = sorted((a, b) for a, b, _ in live.values())
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert hi < lo, f"overlapping files: {ranges}"
    assert all(n <= rows + rows // 2 for _, _, n in live.values()), live


def typed(lake: Path, cache: str) -> Path:
    return list_tables(lake)[cache]


def typed_keys(lake: Path, cache: str) -> list[str]:
    return sorted(
        str(k) for k in DeltaTable(str(typed(lake, cache))).to_pyarrow_table(columns=["key"])["key"].to_pylist()
    )


def expected_keys(rows: list[dict[str, Any]], cache: str) -> list[str]:
    return sorted(k for (c, k) in expected_state(rows) if c == cache)


def seeded(lake: Path, keys: range) -> list[dict[str, Any]]:
    """Two caches holding ``keys`` (four digits: text order is number order), compacted in files of ROWS."""
    rows = [change(c, str(k), f'{{"n": {k}}}', k) for k in keys for c in ("orders", "users")]
    append_changes(lake, rows)
    compact(None, lake, file_rows=ROWS)
    return rows


def test_a_run_in_one_key_range_rewrites_only_that_range_s_files(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000))
    state_files = files(lake / STATE, cache="orders")
    assert len(state_files) == 1000 // ROWS
    assert_disjoint(state_files)
    table = typed(lake, "orders")
    table_files = files(table)
    assert len(table_files) == 1000 // ROWS
    assert_disjoint(table_files)
    users_before = files(lake / STATE, cache="users")
    state_v, table_v = DeltaTable(str(lake / STATE)).version(), DeltaTable(str(table)).version()

    more = [change("orders", str(k), f'{{"n": {k + 5000}}}', 5000 + k) for k in range(1480, 1530)]
    append_changes(lake, more)
    landed += more
    compact(None, lake, file_rows=ROWS)

    assert removed_since(lake / STATE, state_v) == overlapping(state_files, "1480", "1529")
    assert len(overlapping(state_files, "1480", "1529")) == 2
    gone = removed_since(table, table_v)
    assert gone & set(table_files) == overlapping(table_files, 1480, 1529), "the MERGE read no other file"
    assert files(lake / STATE, cache="users") == users_before
    assert state_rows(lake) == expected_state(landed)
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")
    assert_disjoint(files(lake / STATE, cache="orders"))
    assert_disjoint(files(table))


def test_keys_before_between_and_beyond_the_ranges_go_to_the_neighbouring_file(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1100, 1900, 2))  # even keys: odd ones fall between files
    live = files(lake / STATE, cache="orders")
    ordered = sorted(live.items(), key=lambda kv: kv[1][0])
    first, last = ordered[0][0], ordered[-1][0]
    middle, (_, gap_after, _) = ordered[3]
    between = str(int(gap_after) + 1)  # above file 3's range, below file 4's
    state_v = DeltaTable(str(lake / STATE)).version()
    table = typed(lake, "orders")
    table_live, table_v = files(table), DeltaTable(str(table)).version()

    new = [change("orders", k, f'{{"n": {k}}}', 9000 + i) for i, k in enumerate(["1050", between, "1950"])]
    append_changes(lake, new)
    landed += new
    compact(None, lake, file_rows=ROWS)

    assert removed_since(lake / STATE, state_v) == {first, middle, last}
    after = files(lake / STATE, cache="orders")
    assert len(after) == len(live)
    assert_disjoint(after)
    assert state_rows(lake) == expected_state(landed)
    table_ordered = sorted(table_live.items(), key=lambda kv: kv[1][0])
    neighbours = {table_ordered[0][0], table_ordered[3][0], table_ordered[-1][0]}
    assert removed_since(table, table_v) & set(table_live) == neighbours
    assert len(files(table)) == len(table_live), "no small file for a key or two"
    assert_disjoint(files(table))
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")


def test_an_oversized_file_splits_and_deletes_empty_a_range(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000, 4))  # 250 keys: 5 files
    live = files(lake / STATE, cache="orders")
    ordered = sorted(live.items(), key=lambda kv: kv[1][0])
    lo, hi = int(ordered[1][1][0]), int(ordered[1][1][1])
    grow = [change("orders", str(k), f'{{"n": {k}}}', 8000 + k) for k in range(lo + 1, hi) if k % 4]
    assert len(grow) > 2 * ROWS
    victim_lo, victim_hi = ordered[3][1][0], ordered[3][1][1]
    drop = [change("orders", str(k), None, 20000 + k) for k in range(1000, 2000, 4) if victim_lo <= str(k) <= victim_hi]
    state_v = DeltaTable(str(lake / STATE)).version()
    append_changes(lake, grow + drop)
    landed += grow + drop
    compact(None, lake, file_rows=ROWS)

    assert removed_since(lake / STATE, state_v) == {ordered[1][0], ordered[3][0]}
    after = files(lake / STATE, cache="orders")
    assert len(after) == len(live) - 1 + (ROWS + len(grow) + ROWS - 1) // ROWS - 1
    assert_disjoint(after)
    assert not overlapping(after, victim_lo, victim_hi), "the emptied range's file is gone"
    assert state_rows(lake) == expected_state(landed)
    assert_disjoint(files(typed(lake, "orders")))
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")

    # A delete of a key no file holds (or an older change) rewrites nothing.
    state_v = DeltaTable(str(lake / STATE)).version()
    nothing = [change("orders", "1001", None, 30000), change("users", "1000", '{"n": -1}', 1)]
    append_changes(lake, nothing)
    landed += nothing
    compact(None, lake, file_rows=ROWS)
    assert removed_since(lake / STATE, state_v) == set()
    assert state_rows(lake) == expected_state(landed)


def _scatter(table: Path, cache: str | None, parts: int) -> None:
    """The table's (partition's) rows dealt round-robin into ``parts`` files, each spanning every key: as
    many overlapping sorted runs (a layout another writer may leave; no row changes: ``dataChange`` false)."""
    from deltalake.transaction import AddAction, RemoveAction

    from cdcd.lake.maintenance.clustered import read_file, write_file
    from cdcd.lake.storage import open_delta

    dt = open_delta(table)
    schema = pa.schema(dt.schema().to_arrow())
    data_schema = pa.schema([f for f in schema if f.name != "cache"]) if cache is not None else schema
    live = files(table, cache=cache)
    sizes = {f.path: f.size for f in ranged_files(pa.table(dt.get_add_actions(flatten=True)), "key")}
    rows = pa.concat_tables([read_file(table, p, data_schema) for p in live])
    values = {"cache": cache} if cache is not None else {}
    rel_dir = next(iter(live)).rpartition("/")[0]
    actions: list[AddAction | RemoveAction] = [RemoveAction(p, False, 0, sizes[p], values) for p in live]
    for i in range(parts):
        part = rows.take(pa.array(range(i, rows.num_rows, parts)))
        rel, size, stats = write_file(table, rel_dir, part)
        actions.append(AddAction(rel, size, values, 0, False, stats))
    dt.create_write_transaction(actions, "append", dt.schema(), partition_by=["cache"] if cache else None)


def test_the_bound_counts_key_disjoint_files_as_one_run_and_holds_at_every_version(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000))
    policy = FilePolicy(max_files=6, file_rows=ROWS)
    assert len(files(lake / STATE, cache="orders")) == 20 > policy.max_files
    assert bound_compacted(lake, policy) == {}, "20 key-disjoint files are one sorted run"
    assert set(sorted_runs_per_partition(lake / STATE, "key").values()) == {1}

    _scatter(lake / STATE, "users", 8)
    _scatter(typed(lake, "users"), None, 8)
    assert sorted_runs_per_partition(lake / STATE, "key")[("users",)] == 8
    before = {t: DeltaTable(str(t)).version() for t in (lake / STATE, typed(lake, "users"))}
    done = bound_compacted(lake, policy)
    assert set(done) == {STATE, "tables/users"}
    assert sorted_runs_per_partition(lake / STATE, "key")[("users",)] <= policy.max_files
    assert sorted_runs_per_partition(typed(lake, "users"), "key") == {(): 1}
    assert state_rows(lake) == expected_state(landed)
    assert typed_keys(lake, "users") == expected_keys(landed, "users")

    for step in range(4):  # compactions, each followed by the bound, as the daemon runs them
        more = [
            change("users", str(k), '{"n": 0}', 40000 + step * 1000 + k)
            for k in range(1000 + step * 200, 1100 + step * 200)
        ]
        append_changes(lake, more)
        landed += more
        compact(None, lake, file_rows=ROWS)
        bound_compacted(lake, policy)
    for table, first in before.items():
        for version in range(first + 1, DeltaTable(str(table)).version() + 1):
            adds = pa.table(DeltaTable(str(table), version=version).get_add_actions(flatten=True))
            if "partition.cache" in adds.column_names:
                adds = adds.filter(pa.compute.equal(adds.column("partition.cache"), "users"))
            from cdcd.lake.maintenance.clustered import sorted_runs

            assert len(sorted_runs(ranged_files(adds, "key"))) <= policy.max_files, (table, version)
    assert state_rows(lake) == expected_state(landed)
    assert typed_keys(lake, "users") == expected_keys(landed, "users")


def test_every_reader_reads_the_same_rows(tmp_path: Path) -> None:
    import polars as pl

    from cdcd.lake.reading.readers import duckdb_connect

    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 1600))
    more = [change("orders", str(k), None if k % 7 == 0 else f'{{"n": {-k}}}', 50000 + k) for k in range(1200, 1300)]
    more += [change("orders", str(k), f'{{"n": {k}}}', 60000 + k) for k in range(1600, 1630)]
    append_changes(lake, more)
    landed += more
    compact(None, lake, file_rows=ROWS)
    expected = expected_state(landed)
    assert state_rows(lake) == expected
    by_polars = pl.read_delta(str(lake / STATE))
    assert {(r["cache"], r["key"]): r["value"] for r in by_polars.iter_rows(named=True)} == expected
    con = duckdb_connect()
    rows = con.execute(f"SELECT cache, key, value FROM delta_scan('{lake / STATE}')").fetchall()
    assert {(c, k): v for c, k, v in rows} == expected
    table = typed(lake, "orders")
    want = {int(k): json.loads(v)["n"] for (c, k), v in expected.items() if c == "orders"}
    got = DeltaTable(str(table)).to_pyarrow_table(columns=["key", "n"])
    assert dict(zip(got["key"].to_pylist(), got["n"].to_pylist(), strict=True)) == want
    assert dict(pl.read_delta(str(table)).select("key", "n").iter_rows()) == want
    assert dict(con.execute(f"SELECT key, n FROM delta_scan('{table}')").fetchall()) == want
    # Readers skipping files by the key's statistics find each key.
    assert con.execute(f"SELECT n FROM delta_scan('{table}') WHERE key = 1250").fetchall() == [(want[1250],)]
    since = "TIMESTAMPTZ '1970-01-01 00:00:00+00'"
    assert con.execute(f"SELECT count(*) FROM delta_scan('{table}') WHERE _commit_ts > {since}").fetchall() == [
        (len(want),)
    ]
    assert pl.scan_delta(str(lake / STATE)).filter(pl.col("key") == "1629").collect().height == 1
    from tests.support.procs import CDCD

    query = "SELECT key, n FROM orders"
    res = subprocess.run(
        [*CDCD, "lake", "sql", "--lake", str(lake), "--format", "json", query],
        capture_output=True,
        env=child_env(),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert {r["key"]: r["n"] for r in json.loads(res.stdout)} == want


def _compact_in_child(lake: Path, failpoint: str | None) -> subprocess.CompletedProcess[bytes]:
    env = child_env()
    if failpoint is not None:
        env["CDCD_FAILPOINTS"] = failpoint
    code = (
        "from pathlib import Path; from cdcd.lake.maintenance.compact import compact; "
        f"compact(None, Path({str(lake)!r}), file_rows={ROWS})"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=600)


@pytest.mark.parametrize("point", ["lake.recluster.written", "lake.compact.tables_committed", "lake.compact.committed"])
def test_a_compaction_killed_anywhere_converges_exactly_once(tmp_path: Path, point: str) -> None:
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 1500))
    more = [change(c, str(k), f'{{"n": {k + 1}}}', 70000 + k) for k in range(1100, 1180) for c in ("orders", "users")]
    more += [change("orders", str(k), f'{{"n": {k}}}', 80000 + k) for k in range(1500, 1520)]
    end = append_changes(lake, more)
    landed += more
    killed = _compact_in_child(lake, point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    again = _compact_in_child(lake, None)
    assert again.returncode == 0, again.stderr[-3000:]
    assert compacted_version(lake) == end
    assert state_rows(lake) == expected_state(landed)
    for cache in ("orders", "users"):
        keys = typed_keys(lake, cache)
        assert keys == expected_keys(landed, cache), cache
    assert_disjoint(files(lake / STATE, cache="orders"))
    # A table whose clustering commit was lost is clustered by its next MERGE.
    last = [change("orders", "1105", '{"n": 0}', 90000)]
    append_changes(lake, last)
    landed += last
    assert _compact_in_child(lake, None).returncode == 0
    assert_disjoint(files(typed(lake, "orders")))
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")


def test_a_run_over_most_ranges_is_not_cut_again_and_a_narrow_one_clusters_the_table(tmp_path: Path) -> None:
    """Keys spread over most of the table: its MERGE rewrote most files anyway; no second pass cutting that into
    ranges (the next such run would rewrite them all again). The next run of a narrow range of keys does."""
    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000))
    table = typed(lake, "orders")
    spread = [change("orders", str(k), f'{{"n": {-k}}}', 100000 + k) for k in range(1000, 2000, 20)]
    append_changes(lake, spread)
    landed += spread
    version = DeltaTable(str(table)).version()
    compact(None, lake, file_rows=ROWS)
    assert DeltaTable(str(table)).version() == version + 1, "the MERGE alone"
    assert len(files(table)) == 1
    assert_disjoint(files(lake / STATE, cache="orders"))
    narrow = [change("orders", str(k), f'{{"n": {k}}}', 200000 + k) for k in range(1500, 1510)]
    append_changes(lake, narrow)
    landed += narrow
    compact(None, lake, file_rows=ROWS)
    assert len(files(table)) == 1000 // ROWS
    assert_disjoint(files(table))
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")
    assert state_rows(lake) == expected_state(landed)


def test_the_change_data_feed_and_spark_see_the_merge_alone(spark: Any, tmp_path: Path) -> None:
    """The clustering commit changes no data: the typed table's change data feed (delta-rs's and Spark's) holds
    exactly the MERGE's changes; Spark reads `state` and the table as the others do, and a Spark compaction on
    the clustered lake keeps working (its own layout for `state`, the typed tables clustered by delta-rs)."""
    from cdcd.lake.storage import spark_path

    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000))
    table = typed(lake, "orders")
    version = DeltaTable(str(table)).version()
    more = [change("orders", str(k), f'{{"n": {-k}}}', 5000 + k) for k in range(1500, 1503)]
    more.append(change("orders", "1600", None, 9000))
    append_changes(lake, more)
    landed += more
    compact(None, lake, file_rows=ROWS)
    assert DeltaTable(str(table)).version() == version + 2, "the MERGE, then the clustering commit"
    want = [
        (1500, "update_postimage", -1500),
        (1500, "update_preimage", 1500),
        (1501, "update_postimage", -1501),
        (1501, "update_preimage", 1501),
        (1502, "update_postimage", -1502),
        (1502, "update_preimage", 1502),
        (1600, "delete", 1600),
    ]
    cdf = DeltaTable(str(table)).load_cdf(starting_version=version + 1).read_all()
    assert (
        sorted(zip(cdf["key"].to_pylist(), cdf["_change_type"].to_pylist(), cdf["n"].to_pylist(), strict=True)) == want
    )
    frame = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", version + 1)
        .load(spark_path(table))
    )
    assert sorted((r["key"], r["_change_type"], r["n"]) for r in frame.collect()) == want
    rows = spark.read.format("delta").load(spark_path(lake / STATE)).select("cache", "key", "value").collect()
    assert {(r["cache"], r["key"]): r["value"] for r in rows} == expected_state(landed)
    keys = [r["key"] for r in spark.read.format("delta").load(spark_path(table)).select("key").collect()]
    assert sorted(str(k) for k in keys) == expected_keys(landed, "orders")
    # The clustered files' statistics (timestamps with microseconds among them) skip files as Spark reads them.
    frame = spark.read.format("delta").load(spark_path(table))
    assert frame.where("_commit_ts > '1970-01-01' AND key >= 1500 AND key <= 1549").count() == 50
    assert frame.where("_commit_ts < '1970-01-01'").count() == 0

    later = [change("orders", str(k), f'{{"n": {k}}}', 10000 + k) for k in range(1200, 1240)]
    append_changes(lake, later)
    landed += later
    compact(spark, lake, file_rows=ROWS)
    bound_compacted(lake, FilePolicy(max_files=6, file_rows=ROWS))
    assert state_rows(lake) == expected_state(landed)
    assert typed_keys(lake, "orders") == expected_keys(landed, "orders")
    assert_disjoint(files(table))
    assert max(sorted_runs_per_partition(lake / STATE, "key").values()) <= 6


def test_lake_optimize_keeps_the_ranges_and_merges_overlapping_files(spark: Any, tmp_path: Path) -> None:
    """`cdcd lake optimize` bin-packs `changes` with Delta's OPTIMIZE but not `state` and the typed tables (their
    ranges would become one file again): their overlapping files are merged into a sorted run, rows the same."""
    from cdcd.lake.maintenance.ops import optimize

    lake = tmp_path / "lake"
    landed = seeded(lake, range(1000, 2000))
    clustered_state = files(lake / STATE, cache="orders")
    _scatter(lake / STATE, "users", 12)
    _scatter(typed(lake, "users"), None, 12)
    done = optimize(spark, lake)
    # state: one file is the main run, the other 11 (over the smallest tier's 7 of the default bound) one file.
    assert done[STATE]["numFilesRemoved"] == 11 and done["tables/users"]["numFilesRemoved"] == 12
    assert done["tables/orders"]["numFilesRemoved"] == 0
    assert files(lake / STATE, cache="orders") == clustered_state
    assert sorted_runs_per_partition(lake / STATE, "key")[("users",)] == 2
    assert sorted_runs_per_partition(typed(lake, "users"), "key") == {(): 1}
    assert_disjoint(files(typed(lake, "users")), FILE_ROWS)  # the command's files: the default size
    assert state_rows(lake) == expected_state(landed)
    assert typed_keys(lake, "users") == expected_keys(landed, "users")


def test_lake_compact_from_the_command_line_takes_the_file_size(tmp_path: Path) -> None:
    """``cdcd lake compact --file-rows`` clusters as a daemon with ``compact_file_rows`` does (without it: the
    default, one file for these 1,000 keys); a bad value is refused naming the option, and nothing is written."""
    lake = tmp_path / "lake"
    rows = [change(c, str(k), f'{{"n": {k}}}', k) for k in range(1000, 2000) for c in ("orders", "users")]
    append_changes(lake, rows)
    cli = [sys.executable, "-m", "cdcd", "lake", "compact", "--lake", str(lake), "--engine", "deltalake"]

    bad = subprocess.run([*cli, "--file-rows", "0"], capture_output=True, text=True, env=child_env(), timeout=300)
    assert bad.returncode == 2, bad.stderr
    assert "--file-rows" in bad.stderr
    assert compacted_version(lake) == -1

    done = subprocess.run(
        [*cli, "--file-rows", str(ROWS)], capture_output=True, text=True, env=child_env(), timeout=600
    )
    assert done.returncode == 0, done.stderr
    for cache in ("orders", "users"):
        live = files(lake / STATE, cache=cache)
        assert len(live) == 1000 // ROWS
        assert_disjoint(live)
        assert len(files(typed(lake, cache))) == 1000 // ROWS
    assert state_rows(lake) == expected_state(rows)
