"""The bound's rewrites beside the commits (issue 43 items 1 and 4, cdcd/lake/maintenance/autocompact.py
``Rewriter``): the rewrites the commits make due run in a thread of their own while the sink goes on landing
batches, and a commit waits only where it would take a partition past the bound. Checked on the table's log,
version by version: files per partition within the bound at every version, every rewrite removing only files
live just before it and moving no mark; a rewrite that lost to appends made again on top of them, one that lost
a file to another rewrite dropped; with a rewrite held, batches committed until a partition is at the bound and
then none; and a SIGKILL while a rewrite is held leaves only orphan files (the rewrite's merged file, the next
batch's files) and, run again, every WAL entry exactly once."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from cdcd import metrics
from cdcd.lake.maintenance.autocompact import FilePolicy, rewrite_partitions
from cdcd.lake.storage import open_delta
from cdcd.lake.table import CHANGES
from tests.support.delta_lake import check_moment, lake_rows, land_each_record, record_sizes, wal_batch
from tests.support.lake import position, run_to_end, wait_caught_up, write_config
from tests.support.lake_rewrites import (
    Version,
    live_files,
    most_files_at_every_version,
    orphans,
    rewrites,
    same_rows_as_wal,
    split_orphans,
    versions,
)
from tests.support.metrics import try_samples
from tests.support.ports import free_port
from tests.support.procs import reap, start_held_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node

BOUND = 6
"""``max_files_per_partition`` here: small, so every tier is rewritten again and again."""
HELD = "lake.autocompact.written"
"""The fail point a rewrite is held at: its merged files written and fsynced, not committed."""


def _check_sequence(log: list[Version]) -> None:
    """No gap in the log; every rewrite removes only files live at the version before it (never a file another
    rewrite removed first) and moves no mark; every file is removed at most once."""
    assert log, "no commits"
    assert [v.version for v in log] == list(range(len(log))), "a gap in the log"
    live: set[str] = set()
    for v in log:
        if v.rewrite:
            assert not v.marks, f"rewrite {v.version} moved a mark"
            assert set(v.removed) <= live, f"rewrite {v.version} removed files not live: {set(v.removed) - live}"
        live -= set(v.removed)
        live |= set(v.added)
    removed = [path for v in log for path in v.removed]
    assert len(removed) == len(set(removed)), "a file removed twice"


def test_every_version_is_within_the_bound_and_every_rewrite_removes_live_files(tmp_path: Path) -> None:
    """The sink (JVM-free writer, bound 6) lands a node's records one batch each while its rewrites run beside
    it: at every version of the log, rewrites included, no partition holds more than 6 files; every rewrite
    removes files live just before it and moves no mark; no batch was filtered again (no mark moved under the
    sink); the table holds every WAL entry exactly once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=3, tx_per_segment=40)
    batch = wal_batch(node_dir)
    conflicts0 = metrics.LAKE.get_sample_value("cdcd_lake_log_conflicts_total") or 0.0
    sink = land_each_record(lake, batch, max_files=BOUND)
    n = len(batch.peek_slices())
    assert (metrics.LAKE.get_sample_value("cdcd_lake_log_conflicts_total") or 0.0) == conflicts0
    log = versions(lake / CHANGES)
    _check_sequence(log)
    assert sum(v.rewrite for v in log) >= 20, "too few rewrites to say anything"
    assert sum(1 for v in log if v.marks) == n, "one commit per batch"
    assert sink.rows_written == len(wal_events(node_dir))
    over = [(v, most) for v, most in most_files_at_every_version(lake / CHANGES) if most > BOUND]
    assert not over, f"versions over the bound of {BOUND}: {over[:5]}"
    same_rows_as_wal(lake, wal_events(node_dir))


def _small_files(tmp_path: Path) -> tuple[Path, Path]:
    """A lake whose ``changes`` holds a file per record (no bound) and the node it came from."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=1, tx_per_segment=12)
    land_each_record(lake, wal_batch(node_dir), max_files=0)
    return node_dir, lake


def test_a_rewrite_that_lost_to_appends_is_made_again_on_top_of_them(tmp_path: Path) -> None:
    """A rewrite planned at version v commits after a batch's commit at v+1 (an append: its files still live):
    made again at v+2, the batch's files kept, every entry once."""
    node_dir, lake = _small_files(tmp_path)
    table = lake / CHANGES
    stale = open_delta(table)
    before = stale.version()
    land_each_record(lake, wal_batch(node_dir, "other-node"), max_files=0)  # appends meanwhile
    appended = live_files(table) - set(pa.table(stale.get_add_actions(flatten=True)).column("path").to_pylist())
    done = rewrite_partitions(stale, table, FilePolicy(max_files=BOUND), rebases=1)
    assert done is not None and done.version > before + 1 and done.removed > BOUND
    log = versions(table)
    assert log[-1].rewrite and log[-1].version == done.version
    assert appended <= live_files(table), "the batch's files were kept"
    _check_sequence(log)
    rows = lake_rows(lake)
    landed = list(zip(*(rows.column(c).to_pylist() for c in ("source_node", "wal_segment", "wal_offset", "wal_index"))))
    assert len(landed) == len(set(landed)) == 2 * len(wal_events(node_dir)), "each source's entries once"


def test_a_rewrite_whose_files_another_removed_is_dropped(tmp_path: Path) -> None:
    """Two rewrites planned at the same version over the same files (delta-rs's own check lets the second
    commit: its ``append`` mode does not compare removes): the first commits, the second finds a file it
    removes gone and is dropped, its merged file deleted; no row is in the table twice."""
    node_dir, lake = _small_files(tmp_path)
    table = lake / CHANGES
    first, second = open_delta(table), open_delta(table)
    assert rewrite_partitions(first, table, FilePolicy(max_files=BOUND)) is not None
    on_disk = {p for p in table.rglob("*.parquet")}
    assert rewrite_partitions(second, table, FilePolicy(max_files=BOUND), rebases=3) is None
    assert {p for p in table.rglob("*.parquet")} == on_disk, "the lost rewrite's merged file is deleted"
    _check_sequence(versions(table))
    assert versions(table)[-1].rewrite and sum(v.rewrite for v in versions(table)) == 1
    same_rows_as_wal(lake, wal_events(node_dir))


# --- the daemon, a rewrite held at its fail point ------------------------------------------------------------
def _held_daemon(
    tmp_path: Path, node_dir: Path, lake: Path, metrics_port: int = 0
) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    """``cdcd run`` over a backlog (JVM-free writer, bound 6, batches of 40 records) whose second rewrite holds
    at ``HELD``; returns once the daemon went on committing beside it up to the bound and holds too: a
    partition at 6 files in the newest version and the next batch's files written, not committed. (process,
    its config, its stderr, the hold's marker: delete it to go on). ``metrics_port``: its metrics there."""
    make_node(node_dir, segments=6, tx_per_segment=30)
    consumer = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", "max_files_per_partition": BOUND}
    address = f"127.0.0.1:{metrics_port}" if metrics_port else ""
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=400, metrics_address=address)
    proc, err, marker = start_held_daemon(config, tmp_path, HELD, "@2=pause")  # the second rewrite, held
    wait_for(
        lambda: (
            (most_files_at_every_version(lake / CHANGES)[-1][1] == BOUND and _batch_written(lake))
            or proc.poll() is not None
        ),
        120,
        "a partition at the bound and the next batch's files written",
    )
    assert proc.poll() is None, err.read_text()[-3000:]
    return proc, config, err, marker


def _batch_written(lake: Path) -> bool:
    """Whether an orphan of ``changes`` holds records not landed (a batch's files, written, not committed)."""
    try:
        return bool(split_orphans(lake)[1])
    except (OSError, ValueError):  # a file being written this very moment (pyarrow: ArrowInvalid): look again
        return False


@pytest.mark.timeout(600)
def test_batches_commit_beside_a_held_rewrite_until_a_partition_is_at_the_bound(tmp_path: Path) -> None:
    """While the second rewrite is held (its merged file written, not committed), the daemon goes on committing
    batches until a partition holds 6 files, then commits nothing; let go, the rewrite commits on top of them
    (made again at the newest version, not lost) and the daemon goes on; to the end every version is within the
    bound, every rewrite removed live files, no mark moved under the sink and every WAL entry landed exactly
    once. The metrics say so meanwhile: a commit waiting (``cdcd_lake_files_bound_waiting`` 1), the fullest
    partition's small files at the bound, and after the release the seconds waited, at least the hold's."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    port = free_port()
    proc, config, err, marker = _held_daemon(tmp_path, node_dir, lake, port)
    try:
        held = versions(lake / CHANGES)
        at_bound = held[-1]
        last_rewrite = max(v.version for v in held if v.rewrite)
        assert at_bound.marks and last_rewrite < at_bound.version, "batches committed beside the held rewrite"
        wait_for(lambda: (try_samples(port) or {}).get("cdcd_lake_files_bound_waiting") == 1, 60, "a commit waiting")
        time.sleep(1.0)  # room for a commit past the bound to show up (one that waits never does)
        assert versions(lake / CHANGES)[-1].version == at_bound.version, "a commit went past the bound"
        waiting = try_samples(port) or {}
        assert waiting["cdcd_lake_files_bound_waiting"] == 1
        assert waiting["cdcd_lake_small_files_per_partition_max"] == BOUND
        marker.unlink()
        wait_caught_up(proc, config, node_dir, err, 300)
        after = try_samples(port) or {}
    finally:
        rc = stop_daemon(proc, timeout=60)
        reap(proc)
    text = err.read_text()
    assert rc == 0, text[-3000:]
    log = versions(lake / CHANGES)
    assert log[at_bound.version + 1].rewrite, "the held rewrite, made again on top of the batches"
    _check_sequence(log)
    for event in ("lake_autocompact_lost", "lake_commit_conflict", "lake_autocompact_failed"):
        assert event not in text, event
    over = [(v, most) for v, most in most_files_at_every_version(lake / CHANGES) if most > BOUND]
    assert not over, f"versions over the bound of {BOUND}: {over[:5]}"
    same_rows_as_wal(lake, wal_events(node_dir))
    assert after["cdcd_lake_files_bound_waiting"] == 0
    waited_s = after["cdcd_lake_files_bound_wait_seconds_total"] - waiting["cdcd_lake_files_bound_wait_seconds_total"]
    assert waited_s >= 1.0, (waiting, after)  # counted when the wait ends, the hold's second included


@pytest.mark.timeout(600)
def test_sigkill_while_a_rewrite_runs_leaves_only_orphans_and_every_entry_once(tmp_path: Path) -> None:
    """SIGKILLed while the second rewrite is held and the daemon waits for it at the bound with the next batch's
    files written: the log holds neither
    (the rewrite's merged files and the batch's files are orphans, told apart by whether their records are
    landed), no entry twice, the daemon's position not past the lake; run again to the end, every WAL entry is
    in the table exactly once, every version within the bound, and the orphans are still in no version."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    proc, config, _err, marker = _held_daemon(tmp_path, node_dir, lake)
    try:
        rewrites_before = rewrites(lake / CHANGES)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        reap(proc)
    marker.unlink()
    events = wal_events(node_dir)
    positions, sizes = [tuple(e["pos"]) for e in events], record_sizes(events)
    check_moment(lake, positions, sizes, position(config))
    assert rewrites_before == 1 and rewrites(lake / CHANGES) == 1, "the held rewrite never committed"
    merged, batch = split_orphans(lake)
    assert 1 <= len(merged) <= 3, "the held rewrite's merged files (one per partition it rewrote)"
    assert batch, "the next batch's files"
    left = orphans(lake)
    assert left == merged | batch
    run_to_end(config, node_dir, tmp_path / "daemon-final.err")
    same_rows_as_wal(lake, events)
    assert not (left & (live_files(lake / CHANGES) | {p for v in versions(lake / CHANGES) for p in v.added}))
    _check_sequence(versions(lake / CHANGES))
    over = [(v, most) for v, most in most_files_at_every_version(lake / CHANGES) if most > BOUND]
    assert not over, f"versions over the bound of {BOUND}: {over[:5]}"


def _two_partitions(path: Path, due: int, short: int) -> None:
    """A table partitioned by ``cache``: ``due`` one-row files in ``a``, ``short`` in ``b``."""
    for cache, n in (("a", due), ("b", short)):
        for i in range(n):
            write_deltalake(str(path), pa.table({"cache": [cache], "x": [i]}), partition_by=["cache"], mode="append")


@pytest.mark.parametrize("along", [False, True])
def test_a_partition_one_file_short_of_due_is_rewritten_along_with_one_that_is_due(tmp_path: Path, along: bool) -> None:
    """Bound 20 (the smallest tier keeps 7): ``a`` holds 8 small files (due), ``b`` 7 (due at its next commit). The
    writer's rewrite (``along``) rewrites both in one commit, so partitions that fill in step keep sharing their
    rewrites; without it only ``a``. No row is lost or doubled."""
    table = tmp_path / "t"
    _two_partitions(table, 8, 7)
    done = rewrite_partitions(open_delta(table), table, FilePolicy(max_files=20), along=along)
    assert done is not None
    last = versions(table)[-1]
    assert last.rewrite
    assert {dict(p)["cache"] for p in last.partitions_removed} == ({"a", "b"} if along else {"a"})
    assert len(last.removed) == (15 if along else 8)
    rows = DeltaTable(str(table)).to_pyarrow_table()
    assert sorted(zip(rows.column("cache").to_pylist(), rows.column("x").to_pylist(), strict=True)) == [
        *(("a", i) for i in range(8)),
        *(("b", i) for i in range(7)),
    ]
