"""The Spark writer writes one batch ahead (``LakeOptions.write_ahead_max_s``): a call starts its batch's Spark job,
commits the batch the call before it started, and returns False (not durable yet); a call without events
commits the last one and returns True. Against a real SparkSession and the Delta log, version by version:
the commits trail the calls by one, the bound makes a call land its batch within itself, another writer landing
the source in between makes each batch land again filtered (nothing twice), a write that failed is landed whole by
the next call, and a sink stopped with a batch ahead leaves only orphans and the mark before it. The daemon's side
(a call without events once it has nothing more) is tests/test_delivery_confirm.py; a SIGKILL while a batch is
written ahead is the last test here."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cdcd.consumer import EventBatch
from cdcd.lake.landing.delta import ChangeTable
from cdcd.lake.landing.spark_write import PartFiles
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.table import CHANGES
from cdcd.wal.pointer import WalPointer
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import check_moment, lake_rows, record_sizes, sub_batch, wal_batch
from tests.support.lake import TEST_MASTER, TEST_SPARK_CONF, position, run_to_end, write_config
from tests.support.lake_rewrites import orphans, same_rows_as_wal, versions
from tests.support.procs import reap, start_daemon
from tests.support.wal import wal_events
from tests.support.writer import make_node

SOURCE = "test-node"


def _sink(lake: Path, **options: Any) -> LakeConsumer:
    settings = {**NO_MAINTENANCE, "vacuum_interval_s": 0.0, **options}
    return LakeConsumer(
        LakeOptions(lake_path=str(lake), spark_master=TEST_MASTER, spark_conf=TEST_SPARK_CONF, **settings)
    )


def _mark(lake: Path) -> WalPointer | None:
    table = ChangeTable(lake, False)
    table.open()
    return table.mark(SOURCE).last


def _thirds(node_dir: Path) -> list[EventBatch]:
    batch = wal_batch(node_dir, SOURCE)
    n = len(batch.peek_slices())
    return [sub_batch(batch, n * i // 3, n * (i + 1) // 3) for i in range(3)]


def _started(tmp_path: Path, **options: Any) -> tuple[Path, Path, list[EventBatch], LakeConsumer]:
    """A node's WAL in three batches and a started Spark-writer sink: (node dir, lake, batches, sink)."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=3, tx_per_segment=20)
    sink = _sink(lake, **options)
    sink.start()
    return node_dir, lake, _thirds(node_dir), sink


def _last(batch: EventBatch) -> WalPointer:
    return batch.peek_slices()[-1].pointer


NOTHING = EventBatch(SOURCE, [], {})


def test_each_call_commits_the_batch_before_it_and_a_call_without_events_the_last(tmp_path: Path, spark: Any) -> None:
    node_dir, lake, (b1, b2, b3), sink = _started(tmp_path)
    try:
        start = len(versions(lake / CHANGES))
        assert sink.on_events(b1) is False
        assert _mark(lake) is None and len(versions(lake / CHANGES)) == start, "nothing committed yet"
        assert sink.on_events(b2) is False
        assert _mark(lake) == _last(b1)
        assert sink.on_events(b3) is False
        assert _mark(lake) == _last(b2)
        assert sink.on_events(NOTHING) is True
        assert _mark(lake) == _last(b3)
        assert sink.on_events(NOTHING) is True, "nothing ahead: confirmed at once"
        parts = sink._part_files
        assert parts is not None and parts.dir.is_dir() and not any(parts.dir.iterdir()), "each job's part files gone"
    finally:
        sink.stop()
    assert not parts.dir.exists(), "the parts directory removed at the stop"
    assert len(versions(lake / CHANGES)) == start + 3, "one commit per batch"
    assert not orphans(lake)
    same_rows_as_wal(lake, wal_events(node_dir))


def test_at_the_bound_a_call_lands_its_batch_within_itself(tmp_path: Path, spark: Any) -> None:
    node_dir, lake, (b1, b2, b3), sink = _started(tmp_path, write_ahead_max_s=1e-6)
    try:
        assert sink.on_events(b1) is False
        assert sink.on_events(b2) is True, "past the bound: the one ahead and its own batch, both committed"
        assert _mark(lake) == _last(b2)
        assert sink.on_events(b3) is False
        assert sink.on_events(NOTHING) is True
    finally:
        sink.stop()
    same_rows_as_wal(lake, wal_events(node_dir))


def test_another_writer_landing_the_source_in_between_lands_nothing_twice(tmp_path: Path, spark: Any) -> None:
    """The batch ahead was filtered against the mark it would find; another sink lands both batches first:
    at its commit the mark is not that one, so its files are deleted and the batch filtered again (all landed:
    dropped), and so is the batch written ahead of it."""
    node_dir, lake, (b1, b2, b3), sink = _started(tmp_path)
    other = _sink(lake, writer="deltalake")
    other.start()
    try:
        assert sink.on_events(b1) is False
        assert other.on_events(b1) is True and other.on_events(b2) is True
        assert sink.on_events(b2) is False
        assert sink.on_events(b3) is False
        assert sink.on_events(NOTHING) is True
        assert sink.batches_skipped == 2, "b1 and b2 found landed at their commit"
    finally:
        sink.stop()
        other.stop()
    assert not orphans(lake), "the files written for the batches another landed are deleted"
    same_rows_as_wal(lake, wal_events(node_dir))


def test_a_failed_write_is_landed_whole_by_the_next_call(tmp_path: Path, spark: Any) -> None:
    """The Spark job of the batch ahead fails (its table's directory replaced by a file under it): the next call
    raises its error; called again once the directory is back, it lands that batch within itself first, then
    goes on writing ahead."""
    node_dir, lake, (b1, b2, b3), sink = _started(tmp_path)
    partitions = lake / CHANGES
    try:
        assert sink.on_events(b1) is False
        assert sink.on_events(NOTHING) is True
        moved = tmp_path / "partitions"
        kept = [p for p in partitions.iterdir() if p.name.startswith("cache=")]
        moved.mkdir()
        for p in kept:
            shutil.move(str(p), moved / p.name)
            p.write_text("not a directory")
        assert sink.on_events(b2) is False, "its job is written ahead, in the background"
        with pytest.raises(Exception, match="rows to"):
            sink.on_events(b3)
        for p in kept:
            p.unlink()
            shutil.move(str(moved / p.name), p)
        assert sink.on_events(b3) is False, "b2 landed whole, b3 ahead"
        assert _mark(lake) == _last(b2)
        assert sink.on_events(NOTHING) is True
    finally:
        sink.stop()
    same_rows_as_wal(lake, wal_events(node_dir))


def test_a_sink_stopped_with_a_batch_ahead_leaves_the_mark_before_it(tmp_path: Path, spark: Any) -> None:
    node_dir, lake, (b1, b2, b3), sink = _started(tmp_path)
    try:
        assert sink.on_events(b1) is False
        assert sink.on_events(b2) is False
    finally:
        sink.stop()
    assert _mark(lake) == _last(b1)
    assert not orphans(lake), "the batch ahead's files are deleted at the stop"
    again = _sink(lake)
    again.start()
    try:
        for batch in (b1, b2, b3):  # the daemon's next start reads from its position, before b1 at most
            again.on_events(batch)
        assert again.on_events(NOTHING) is True
    finally:
        again.stop()
    same_rows_as_wal(lake, wal_events(node_dir))


@pytest.mark.timeout(600)
def test_sigkill_while_a_batch_is_written_ahead_lands_every_entry_once(tmp_path: Path) -> None:
    """``cdcd run`` (Spark writer, batches of 200 entries) SIGKILLed right after committing a batch while the next
    one's Spark job runs: the lake holds the first, the daemon's position is before it; run again to the end,
    every WAL entry is in ``changes`` exactly once and the daemon's committed position reaches the end (the call
    without events once it has read everything)."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=4, tx_per_segment=40)
    consumer = {
        "kind": "lake",
        "lake_path": str(lake),
        "spark_master": TEST_MASTER,
        **NO_MAINTENANCE,
        "vacuum_interval_s": 0.0,
    }
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=200)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env={"CDCD_FAILPOINTS": "lake.write_ahead.committed@2"})
    try:
        assert proc.wait(300) == -signal.SIGKILL, err.read_text()[-3000:]
    finally:
        reap(proc)
    events = wal_events(node_dir)
    landed = lake_rows(lake).num_rows
    assert 0 < landed < len(events), f"{landed} of {len(events)} rows landed before the kill"
    positions, sizes = [tuple(e["pos"]) for e in events], record_sizes(events)
    check_moment(lake, positions, sizes, position(config))  # no entry twice, the daemon's position not past the lake
    run_to_end(config, node_dir, tmp_path / "daemon-final.err")  # the daemon's position at the end, too
    same_rows_as_wal(lake, events)


def test_part_files_of_processes_that_are_gone_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon SIGKILLed mid-job leaves its parts directory; the next ``PartFiles`` removes those of processes
    that are gone, never a living one's, a link or another name."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"{PartFiles.PREFIX}{gone.pid}-abc"
    stale.mkdir()
    (stale / "part").write_bytes(b"x" * 100)
    living = tmp_path / f"{PartFiles.PREFIX}{1}-def"
    living.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"{PartFiles.PREFIX}{gone.pid}-link"
    link.symlink_to(target, target_is_directory=True)
    other = tmp_path / "cdcd-lake-parts-notapid"
    other.mkdir()
    files = PartFiles()
    try:
        assert files.dir.parent == tmp_path and files.dir.stat().st_mode & 0o777 == 0o700
        assert not stale.exists()
        assert living.is_dir() and link.is_symlink() and target.is_dir() and other.is_dir()
        part = files.write(b"shipped")
        assert part.read() == b"shipped"
    finally:
        files.close()
    assert not files.dir.exists()
