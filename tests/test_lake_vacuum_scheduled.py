"""The scheduled vacuum (cdcd/lake/maintenance/vacuum_rs.py): every file no snapshot names deleted once older than
the retention, on a real lake folded by compaction; what compaction has yet to read kept whatever its age; a longer
retention set by hand kept; the maintainer running it on its own; no JVM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from cdcd import metrics
from cdcd.lake.cuts import latest_cut
from cdcd.lake.deltalog import last_checkpoint
from cdcd.lake.maintenance.autocompact import FilePolicy, bound_changes
from cdcd.lake.maintenance.compact import compact, state_lag
from cdcd.lake.maintenance.log_cleanup import clean_logs
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
from cdcd.lake.maintenance.ops import data_files_on_disk, optimize
from cdcd.lake.maintenance.vacuum_rs import (
    EXPIRED_LOG_CLEANUP,
    LOG_RETENTION,
    RETENTION,
    SET_BY_CDCD,
    sweep_lake,
    vacuum,
)
from cdcd.lake.reading.readers import polars_frames
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.table import CHANGES, CHANGES_LOG_PROPERTIES, CUTS, STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.cli import run_cli
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.lake import run_to_end, wait_started, write_config
from tests.support.lake_rewrites import same_rows_as_wal
from tests.support.procs import log_events, stop_daemon, wait_for
from tests.support.wal import wal_events, wal_fold
from tests.support.writer import make_node, start_writer

HOUR_S = 3600


def _tables(lake: Path) -> list[Path]:
    return [lake / CHANGES, lake / STATE, *(Path(str(p)) for _, p in sorted(list_tables(lake).items()))]


def _live(table: Path) -> set[Path]:
    adds = pa.table(DeltaTable(str(table)).get_add_actions(flatten=True))
    return {table / p for p in adds.column("path").to_pylist()}


def _on_disk(table: Path) -> set[Path]:
    return {Path(str(p)) for p in data_files_on_disk(table)}


def _age(paths: set[Path], hours: float) -> None:
    then = time.time() - hours * HOUR_S
    for path in paths:
        os.utime(path, (then, then))


def _fold(lake: Path, rows: list[dict[str, object]], n: int, *, compacted: bool = True) -> None:
    """Two caches, keys 0-2 updated again: each fold rewrites state's and the typed tables' files and writes the
    typed tables' change data feed."""
    new = [change(c, str(k % 3), json.dumps({"n": n, "k": k}), n * 10 + k) for k in range(6) for c in ("a", "b")]
    rows += new
    append_changes(lake, new)
    if compacted:
        compact(None, lake)


def _age_log(table: Path, hours: float, *, commits_after: int | None = None) -> None:
    """``table``'s removes as if made ``hours`` earlier (a tombstone's age is its ``deletionTimestamp``), and the
    ``commitInfo.timestamp`` of its commits after version ``commits_after`` (None: none); checkpoints deleted, so
    readers replay the commits as rewritten."""
    shift_ms = int(hours * HOUR_S * 1000)
    log_dir = table / "_delta_log"
    for path in sorted(log_dir.glob("*.json")):
        version = int(path.stem)
        lines, changed = [], False
        for line in path.read_text().splitlines():
            action = json.loads(line)
            info = action.get("commitInfo")
            if info is not None and "timestamp" in info and commits_after is not None and version > commits_after:
                info["timestamp"] -= shift_ms
                changed = True
            if "remove" in action and action["remove"].get("deletionTimestamp"):
                action["remove"]["deletionTimestamp"] -= shift_ms
                changed = True
            lines.append(json.dumps(action))
        if changed:  # others left byte for byte: compaction's mark knows the commit it folded to by its bytes
            path.write_text("\n".join(lines) + "\n")
    for path in [*log_dir.glob("*.checkpoint*.parquet"), log_dir / "_last_checkpoint"]:
        path.unlink(missing_ok=True)


def _age_all(table: Path, hours: float, *, commits_after: int | None = None) -> None:
    _age(_on_disk(table), hours)
    _age_log(table, hours, commits_after=commits_after)


def test_vacuum_deletes_what_no_snapshot_names_once_older_than_the_retention(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(8):
        _fold(lake, rows, n)
    assert bound_changes(lake, FilePolicy(max_files=6)) is not None  # changes' small files rewritten
    tables = _tables(lake)
    assert len(tables) == 4
    hand_set = tables[3]  # a typed table whose owner keeps replaced files two days
    DeltaTable(str(hand_set)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 48 hours"})
    live = {t: _live(t) for t in tables}
    disk = {t: _on_disk(t) for t in tables}
    for table in tables:
        assert disk[table] > live[table], table  # replaced files (and the change data feed) stay on disk
    feed = {p for t in tables for p in disk[t] if "_change_data" in p.parts}
    assert feed, "the typed tables' MERGEs wrote a change data feed"
    orphan = lake / CHANGES / "cache=a" / "part-99999-orphan.c000.zstd.parquet"  # a write that never committed
    orphan.write_bytes(b"PAR1 never committed")
    for table in tables:
        _age_all(table, 30)
    _age({orphan}, 30)
    in_flight = lake / CHANGES / "cache=b" / "part-99998-in-flight.c000.zstd.parquet"  # written, not committed yet
    in_flight.write_bytes(b"PAR1 about to commit")
    assert not state_lag(lake)[2]

    deleted_before = metrics.LAKE.get_sample_value("cdcd_lake_vacuum_deleted_bytes_total", {"table": "state"})
    swept = sweep_lake(lake, 24)

    for table in tables:
        left = _on_disk(table)
        if table == hand_set:
            assert left == disk[table], "48 h set by hand: nothing of 30 h deleted"
            continue
        assert left == live[table] | ({in_flight} if table == lake / CHANGES else set()), table
        name = table.relative_to(lake).as_posix()
        assert swept[name].deleted_files == len(disk[table] - live[table]) + (table == lake / CHANGES)
        assert swept[name].retain_hours == 24
    assert swept[hand_set.relative_to(lake).as_posix()].retain_hours == 48
    assert not orphan.exists() and in_flight.exists()
    assert deleted_before is None  # the maintainer counts bytes; sweep_lake alone does not
    # Every reader still reads every row.
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]
    assert DeltaTable(str(lake / CHANGES)).to_pyarrow_table().num_rows == len(rows)
    for table in tables[2:]:
        assert DeltaTable(str(table)).to_pyarrow_table().num_rows == 3
    # Nothing more to delete; and compaction goes on past the vacuum's commits in changes' log.
    again = sweep_lake(lake, 24)
    assert all(s.deleted_files == 0 for s in again.values()), again
    ops = [h["operation"] for h in DeltaTable(str(lake / CHANGES)).history(3)]
    assert ops[:2] == ["VACUUM END", "VACUUM START"], ops
    _fold(lake, rows, 8)
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]


def _tombstones_checkpointed(table: Path) -> int:
    """Tombstones (``remove`` actions) a checkpoint of ``table`` written now carries."""
    DeltaTable(str(table)).create_checkpoint()
    found = last_checkpoint(table)
    assert found is not None, table
    parts = sorted((table / "_delta_log").glob(f"{found[0]:020d}.checkpoint*.parquet"))
    return sum(pq.read_table(p, columns=["remove"]).column("remove").drop_null().__len__() for p in parts)


def _retention(table: Path, prop: str = RETENTION) -> tuple[str | None, str | None]:
    """``prop`` of ``table`` and cdcd's note of the value it set."""
    conf = DeltaTable(str(table)).metadata().configuration
    return conf.get(prop), conf.get(SET_BY_CDCD[prop])


def _age_log_files(table: Path, hours: float) -> None:
    """Every file of ``table``'s log ``hours`` old (the log cleanup takes a commit file's time as the commit's)."""
    then = time.time() - hours * HOUR_S
    for path in (table / "_delta_log").iterdir():
        if path.is_file():
            os.utime(path, (then, then))


def test_tombstones_and_the_log_are_kept_as_long_as_the_files_and_follow_the_setting(tmp_path: Path) -> None:
    """Delta's week of tombstones would ride in every checkpoint of state and the typed tables, and its 30 days of
    log be listed at every open of those and of _cuts: the vacuum sets both retentions to its own, moves them when
    the setting changes, and leaves changes' own and a value set by hand (before or after cdcd set one) alone."""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(6):
        _fold(lake, rows, n)
    changes, state, typed_a, typed_b = _tables(lake)
    cuts = lake / CUTS
    DeltaTable(str(typed_b)).alter.set_table_properties({RETENTION: "interval 48 hours"})
    for table in (state, typed_a, typed_b):
        _age_all(table, 30)
        assert _retention(table)[1] is None and _retention(table, LOG_RETENTION) == (None, None)
    # Replaced 30 h ago: under Delta's default week, a checkpoint carries them.
    before = {t: _tombstones_checkpointed(t) for t in (state, typed_a, typed_b)}
    assert all(before.values()), before
    DeltaTable(str(cuts)).create_checkpoint()
    for table in (state, cuts):
        _age_log_files(table, 30)
    kept = clean_logs(lake, state_lag(lake)[1])
    assert kept[STATE].deleted == kept[CUTS].deleted == 0  # 30 h of log kept under Delta's 30 days

    sweep_lake(lake, 24)

    for table in (state, typed_a):
        assert _retention(table) == ("interval 24 hours", "interval 24 hours"), table
        assert _tombstones_checkpointed(table) == 0, table  # older than 24 h: dropped
    for table in (state, typed_a, typed_b, cuts):
        assert _retention(table, LOG_RETENTION) == ("interval 24 hours", "interval 24 hours"), table
    assert _retention(typed_b) == ("interval 48 hours", None)
    assert _tombstones_checkpointed(typed_b) == before[typed_b]  # 30 h < its own 48 h: carried
    assert changes_conf(changes) == (CHANGES_LOG_PROPERTIES[RETENTION], CHANGES_LOG_PROPERTIES[LOG_RETENTION])
    _fold(lake, rows, 6)
    clean_logs(lake, state_lag(lake)[1])  # what the maintainer does after each compaction (and delta-rs at a
    for table in (state, cuts):  # checkpoint of a table with its own cleanup on): 30 h is past the retention now
        assert min(int(p.name[:20]) for p in (table / "_delta_log").glob("*.json")) > 0, table

    # The setting changes: cdcd's value follows it; by hand (here after cdcd set one) it is kept.
    DeltaTable(str(typed_a)).alter.set_table_properties({RETENTION: "interval 72 hours"})
    sweep_lake(lake, 12)
    assert _retention(state) == ("interval 12 hours", "interval 12 hours")
    assert _retention(typed_a) == ("interval 72 hours", "interval 24 hours")
    assert _retention(typed_a, LOG_RETENTION) == ("interval 12 hours", "interval 12 hours")
    assert _retention(typed_b) == ("interval 48 hours", None)
    version = DeltaTable(str(state)).version()
    sweep_lake(lake, 12)
    assert DeltaTable(str(state)).version() == version  # set already: no commit

    # Every reader still reads every row, and compaction goes on past the property commits.
    _fold(lake, rows, 7)
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]
    for table in (typed_a, typed_b):
        assert DeltaTable(str(table)).to_pyarrow_table().num_rows == 3
    assert {cache: f.height for cache, f in polars_frames(lake).items()} == {"a": 3, "b": 3}


def changes_conf(changes: Path) -> tuple[str | None, str | None]:
    conf = DeltaTable(str(changes)).metadata().configuration
    assert not any(k.startswith("cdcd.") for k in conf), conf
    return conf.get(RETENTION), conf.get(LOG_RETENTION)


def test_spark_compacts_optimizes_and_reads_tables_with_cdcds_retention(tmp_path: Path, spark: Any) -> None:
    """The Spark writer's maintenance on tables the vacuum set the retention on: Delta's Spark takes the
    ``cdcd.`` property beside its own (its MERGE, OPTIMIZE and reads), and the files they replace have their
    tombstones dropped once older than the retention."""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(3):
        _fold(lake, rows, n)
    sweep_lake(lake, 24)
    state = lake / STATE
    assert _retention(state) == ("interval 24 hours", "interval 24 hours")
    assert _retention(state, LOG_RETENTION) == ("interval 24 hours", "interval 24 hours")
    for n in range(3, 5):
        new = [change(c, str(k % 3), json.dumps({"n": n, "k": k}), n * 10 + k) for k in range(6) for c in ("a", "b")]
        rows += new
        append_changes(lake, new)
        compact(spark, lake)
    optimize(spark, lake)
    assert _retention(state) == ("interval 24 hours", "interval 24 hours")
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]
    assert spark.read.format("delta").load(str(state)).count() == 6
    _age_all(state, 30)  # Spark's MERGEs and OPTIMIZE replaced files too: dropped once older than 24 h
    assert _tombstones_checkpointed(state) == 0


def test_a_quiet_lake_keeps_the_files_of_the_versions_its_latest_cut_names(tmp_path: Path) -> None:
    """Readers open each typed table at the version the latest cut names. A rewrite that changes no rows after the
    last compaction (what the bound and OPTIMIZE commit) replaces that version's files, and the source then stays
    quiet for longer than the retention: the vacuum keeps them, so the cut reads as before (without the rule the
    read fails: the files are gone); once a compaction records a newer cut, the next vacuum deletes them."""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(3):
        _fold(lake, rows, n)
    cut = latest_cut(lake)
    assert cut is not None
    typed = Path(str(list_tables(lake)["a"]))
    assert cut.tables["a"] == DeltaTable(str(typed)).version()
    at_cut = _live(typed)
    DeltaTable(str(typed)).optimize.z_order(["key"])  # rows unchanged, files replaced, no new cut
    assert DeltaTable(str(typed)).version() > cut.tables["a"] and not at_cut & _live(typed)
    for table in _tables(lake):
        _age_all(table, 30)

    swept = sweep_lake(lake, 24)

    assert swept["tables/a"].retain_hours == 32  # 30 h and seconds: 31 whole hours, and the margin
    assert at_cut <= _on_disk(typed)
    assert swept["tables/b"].deleted_files > 0 and swept["tables/b"].retain_hours == 24  # its cut is its latest
    # The log too: Delta's own cleanup is off on the typed tables, and cdcd's keeps the cut's version past a
    # checkpoint after it, the whole log being older than the 24 h the vacuum set.
    assert DeltaTable(str(typed)).metadata().configuration[EXPIRED_LOG_CLEANUP] == "false"
    DeltaTable(str(typed)).create_checkpoint()
    _age_log_files(typed, 30)
    assert clean_logs(lake, state_lag(lake)[1])["tables/a"].kept_from <= cut.tables["a"]
    frames = polars_frames(lake)
    assert {cache: f.height for cache, f in frames.items()} == {"a": 3, "b": 3}
    assert sorted(frames["a"]["key"].to_list()) == [0, 1, 2]

    _fold(lake, rows, 3)  # the source writes again: a newer cut
    sweep_lake(lake, 24)
    assert not at_cut & _on_disk(typed)
    assert {cache: f.height for cache, f in polars_frames(lake).items()} == {"a": 3, "b": 3}


def test_cdcd_lake_vacuum_keeps_the_files_of_the_versions_the_latest_cut_names(tmp_path: Path) -> None:
    """`cdcd lake vacuum` (Delta's 168 h by default) on a lake quiet for longer since a rewrite after its last cut:
    the cut's files stay and the cut reads as before; the other typed table loses its replaced files. (Spark's
    VACUUM, which the command ran before, deleted the cut's files: it deletes a file no snapshot names once older
    than the table's own retention, 168 h here, whatever retention it is given.)"""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(3):
        _fold(lake, rows, n)
    typed = Path(str(list_tables(lake)["a"]))
    at_cut = _live(typed)
    DeltaTable(str(typed)).optimize.z_order(["key"])
    other = Path(str(list_tables(lake)["b"]))
    replaced = _on_disk(other) - _live(other)
    assert replaced
    for table in _tables(lake):
        _age_all(table, 200)

    done = vacuum(lake, 168)

    assert at_cut <= _on_disk(typed) and done["tables/a"].deleted_files == 0
    assert not replaced & _on_disk(other) and done["tables/b"].deleted_files == len(replaced)
    assert {cache: f.height for cache, f in polars_frames(lake).items()} == {"a": 3, "b": 3}


def test_changes_keeps_what_compaction_has_yet_to_read_whatever_its_age(tmp_path: Path) -> None:
    """Commits compaction has not folded: their files stay even once replaced and older than the retention, and
    compaction folds them after the vacuum. Without the rule they would be deleted (aged 30 h, retention 24 h)."""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    _fold(lake, rows, 0)
    done = DeltaTable(str(lake / CHANGES)).version()
    for n in range(1, 8):
        _fold(lake, rows, n, compacted=False)
    assert bound_changes(lake, FilePolicy(max_files=6)) is not None
    changes = lake / CHANGES
    unfolded = _on_disk(changes) - _live(changes)
    assert unfolded, "the bound replaced files compaction has not read yet"
    for table in _tables(lake):
        _age_all(table, 30, commits_after=done if table == changes else None)
    assert state_lag(lake)[2]

    swept = sweep_lake(lake, 24)

    # 30 h and some seconds behind: 31 whole hours, plus the hour a file may be written before its commit.
    assert swept[CHANGES].deleted_files == 0 and swept[CHANGES].retain_hours == 32
    assert unfolded <= _on_disk(changes)
    compact(None, lake)
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]
    # Folded now: the next vacuum deletes them.
    swept = sweep_lake(lake, 24)
    assert swept[CHANGES].retain_hours == 24
    assert not unfolded & _on_disk(changes)


def _vacuum_once(lake: Path) -> None:
    """A maintainer that only vacuums (every 0.2 s, retention 1 h), stopped after its first vacuum."""
    opts = MaintainerOptions(compact_interval_s=0, optimize_interval_s=0, vacuum_interval_s=0.2, vacuum_retain_hours=1)
    maintainer = Maintainer(lake, None, opts)
    maintainer.start()
    try:
        deadline = time.monotonic() + 60
        while maintainer.vacuums < 1:
            assert maintainer.alive() and time.monotonic() < deadline, maintainer.last_failure
            time.sleep(0.05)
    finally:
        maintainer.stop()


def test_the_maintainer_vacuums_on_its_own_and_counts_the_bytes(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(3):
        _fold(lake, rows, n)
    state = lake / STATE
    replaced = _on_disk(state) - _live(state)
    assert replaced
    _age_all(state, 2)
    before = metrics.LAKE.get_sample_value("cdcd_lake_vacuum_deleted_bytes_total", {"table": "state"}) or 0.0
    size = sum(p.stat().st_size for p in replaced)
    _vacuum_once(lake)
    assert not replaced & _on_disk(state)
    after = metrics.LAKE.get_sample_value("cdcd_lake_vacuum_deleted_bytes_total", {"table": "state"})
    assert after == before + size
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]


def _first_logged(table: Path) -> int:
    return min(int(p.name[:20]) for p in (table / "_delta_log").glob("*.json"))


def test_logs_are_cleaned_where_no_compaction_runs_by_the_vacuum_and_by_cdcd_lake_compact(tmp_path: Path) -> None:
    """Compaction from a timer (`cdcd lake compact`) and a daemon that only optimizes and vacuums: the log cleanup
    that ran only after the maintainer's compactions now runs after each vacuum too, and after the command. Logs 30 h
    old under retentions of 2 minutes (changes) and of the vacuum's hour go, but for the versions still needed."""
    lake = tmp_path / "lake"
    rows: list[dict[str, object]] = []
    for n in range(3):
        _fold(lake, rows, n)
    tables = _tables(lake)
    for table in tables:
        DeltaTable(str(table)).create_checkpoint()
        _age_log_files(table, 30)
    assert all(_first_logged(t) == 0 for t in tables)
    _vacuum_once(lake)
    assert all(_first_logged(t) > 0 for t in tables), {str(t): _first_logged(t) for t in tables}
    assert {cache: f.height for cache, f in polars_frames(lake).items()} == {"a": 3, "b": 3}

    # The command, on changes committed since (never compacted, so kept until it folds them).
    new = [change(c, str(k), json.dumps({"n": 9, "k": k}), 900 + k) for k in range(3) for c in ("a", "b")]
    for row in new:
        append_changes(lake, [row])
    rows += new
    changes = lake / CHANGES
    DeltaTable(str(changes)).create_checkpoint()
    _age_log_files(changes, 30)
    latest = DeltaTable(str(changes)).version()
    res = run_cli("lake", "compact", "--lake", str(lake), "--engine", "deltalake")
    assert res.returncode == 0, res.stderr
    assert _first_logged(changes) == latest  # the checkpoint at the last version folded, and on
    assert state_rows(lake) == expected_state(rows)  # type: ignore[arg-type]


def test_vacuum_settings(tmp_path: Path) -> None:
    lake = str(tmp_path / "lake")
    options = LakeOptions(lake_path=lake, writer="deltalake")
    assert (options.vacuum_interval_s, options.vacuum_retain_hours) == (3600.0, 24)
    made = options.maintainer_options()
    assert (made.vacuum_interval_s, made.vacuum_retain_hours) == (3600.0, 24)
    with pytest.raises(msgspec.ValidationError, match=r"vacuum_retain_hours = 0: must be >= 1"):
        LakeOptions(lake_path=lake, vacuum_retain_hours=0)
    with pytest.raises(msgspec.ValidationError, match=r"vacuum_interval_s = -1"):
        LakeOptions(lake_path=lake, vacuum_interval_s=-1)
    # In a node's process the daemon's sink maintains the lake: no vacuum there unless asked.
    realtime = LakeConsumer.from_options({"lake_path": lake}, "realtime_consumer")
    assert realtime.options.vacuum_interval_s == 0


@pytest.mark.timeout(600)
def test_a_live_daemon_vacuums_beside_landing_and_compaction_and_loses_nothing(tmp_path: Path) -> None:
    """`cdcd run` lands live transactions with the JVM-free writer, compacts every 2 s and vacuums every second
    (retention 1 h) while old orphans keep appearing in `changes`, `state` and a typed table (writes that never
    committed, two hours old): the vacuums delete them and commit beside the sink's batches, the bound's rewrites
    and compaction's MERGEs. No maintenance run fails, every WAL entry is in `changes` exactly once and `state` is
    the WAL's fold; a last vacuum leaves none of the orphans."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=1, tx_per_segment=5)
    consumer = {
        "kind": "lake",
        "lake_path": str(lake),
        "writer": "deltalake",
        "compact_interval_s": 2.0,
        "optimize_interval_s": 10.0,
        "vacuum_interval_s": 1.0,
        "vacuum_retain_hours": 1,
    }
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_delay_ms=100)
    err = tmp_path / "daemon.err"
    proc = subprocess.Popen([sys.executable, "-m", "cdcd", "run", "--config", str(config)], stderr=err.open("wb"))
    planted: list[Path] = []
    stop = threading.Event()

    def plant() -> None:
        """An old orphan in each table's directory every half second, once the table exists."""
        while not stop.wait(0.5):
            tables = [lake / CHANGES, lake / STATE, *(Path(str(p)) for p in list(list_tables(lake).values())[:1])]
            for table in tables:
                if not (table / "_delta_log").is_dir():
                    continue
                where = table / "cache=orders" if table.name in (CHANGES, STATE) else table
                where.mkdir(exist_ok=True)
                orphan = where / f"part-{len(planted):05d}-orphan-never-committed.c000.zstd.parquet"
                orphan.write_bytes(b"PAR1 never committed")
                _age({orphan}, 2)
                planted.append(orphan)

    def swept_both() -> bool:
        """A vacuum has deleted orphans of `changes` and of `state` (each beside the landing and compaction)."""
        tables = {e["table"] for e in log_events(err) if e["event"] == "lake_vacuumed"}
        return {CHANGES, STATE} <= tables

    planter = threading.Thread(target=plant, daemon=True)
    load = None
    try:
        wait_started(proc, err, timeout=240)
        load = start_writer(tmp_path, node_dir, pause_ms=20)
        planter.start()
        wait_for(
            lambda: proc.poll() is not None or swept_both(), 300, "vacuums of changes and state beside the landing"
        )
        (tmp_path / "writer.stop").touch()
        assert load.wait(120) == 0
    finally:
        stop.set()
        planter.join(10)
        (tmp_path / "writer.stop").touch()
        if load is not None:
            load.wait(120)
        rc = stop_daemon(proc, timeout=120)
    events = log_events(err)
    assert rc == 0, err.read_text()[-3000:]
    assert not [e for e in events if e["event"] == "lake_maintenance_failed"], err.read_text()[-3000:]
    swept = [e for e in events if e["event"] == "lake_vacuumed"]
    assert {e["table"] for e in swept} >= {CHANGES, STATE}, swept[-5:]
    # The vacuums' reports count the files of their plan (one planted between a plan and its run is deleted too,
    # uncounted): never more than the orphans gone. That nothing else went, the rows below show.
    gone = [p for p in planted if not p.exists()]
    assert 2 <= sum(int(str(e["deleted"])) for e in swept) <= len(gone), (len(gone), swept)
    for table in (lake / CHANGES, lake / STATE):
        ops = [h["operation"] for h in DeltaTable(str(table)).history()]
        assert "VACUUM END" in ops, (table, ops[:10])
    run_to_end(config, node_dir, tmp_path / "daemon-final.err")
    wal = wal_events(node_dir)
    same_rows_as_wal(lake, wal)
    compact(None, lake)
    got = {(c, json.dumps(json.loads(k))): json.loads(v) for (c, k), v in state_rows(lake).items()}
    assert got == wal_fold(wal)
    sweep_lake(lake, 1)
    assert not [p for p in planted if p.exists()]
