"""A lake behind the node's realtime worker (issue 28): restored from a backup taken while realtime CDC delivered.

The worker resuming ON asks its consumer (``resume_at``) with the last record it delivered; a lake behind it
hands delivery to the daemon with a Stop record carrying that record, and the daemon's rewind lands again what
the lake lost, from the node's archive, or stops with one line (exit 9) when the archive lost it too. The
reference is the WAL: ``check_lake`` wants every entry in the lake exactly once. In process: a real node with
its realtime worker, a real daemon (``sync_once``), real WAL, LMDB and Delta tables.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon.rewind import TargetBehind
from cdcd.daemon_state import CdcMode
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.node import Node
from cdcd.realtime.machine import RealtimeMode
from cdcd.wal.records import StopRealtimeCdcRecord
from tests.support.delta_lake import check_lake, lake_consumer, lake_rows
from tests.support.procs import wait_for
from tests.support.realtime import markers
from tests.support.wal import archived_segments, wal_events
from tests.support.writer import write_tx

NODE = {
    "wal_mode": "fsync",
    "wal_segment_size_bytes": 64 * 1024,
    "wal_force_archive_timeout_ms": 0,
    "archive_max_bytes": 0,  # keep every segment: the WAL is the reference
    "realtime_commit_record_interval_ms": 0,
}


def rewinds() -> float:
    return REGISTRY.get_sample_value("cdcd_daemon_rewinds_total") or 0.0


@contextmanager
def daemon(node_dir: Path, lake: Path) -> Iterator[Daemon]:
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer=lake_consumer(lake))
    with Daemon(
        config,
        LakeConsumer(
            LakeOptions(lake_path=str(lake), writer="deltalake", compact_interval_s=0.0, optimize_interval_s=0.0)
        ),
    ) as d:
        yield d


def open_node(node_dir: Path, lake: Path) -> Node:
    return Node.open(node_dir, realtime_cdc=True, realtime_consumer=lake_consumer(lake), **NODE)


def write(node: Node, first: int, count: int) -> int:
    for n in range(first, first + count):
        write_tx(node, n)
    node.force_archive()
    return first + count


def realtime_on(node: Node, node_dir: Path, lake: Path) -> None:
    """The daemon passes the node's TryStart (one pass), and the node's worker goes ON."""
    assert node.realtime.mode is not RealtimeMode.OFF
    with daemon(node_dir, lake) as d:
        d.sync_once()
        assert d.state.mode is CdcMode.NODE_ACTIVE
    wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 60, "realtime on")


def delivered_all(node: Node, node_dir: Path) -> None:
    """The realtime worker confirmed every entry the WAL holds now."""
    last = tuple(wal_events(node_dir)[-1]["pos"])

    def past() -> bool:
        pos = node.realtime.position
        return pos is not None and (pos.segment, pos.offset, pos.entry_index) > last

    wait_for(past, 60, "the realtime worker to confirm every entry")


def restored_lake_behind_realtime(tmp_path: Path) -> tuple[Path, Path, int]:
    """Realtime delivers to the lake; a lake backup is taken mid-run; the node closes; the backup is copied
    back. Returns (node dir, lake, the next transaction number)."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "lake-backup"
    node = open_node(node_dir, lake)
    try:
        realtime_on(node, node_dir, lake)
        n = write(node, 0, 40)
        delivered_all(node, node_dir)
        shutil.copytree(lake, backup)
        n = write(node, n, 60)
        delivered_all(node, node_dir)
        with daemon(node_dir, lake) as d:  # PASSIVE: commits the node's markers, deletes the links
            d.sync_once()
            assert d.state.mode is CdcMode.NODE_ACTIVE
    finally:
        node.close()
    check_lake(lake, node_dir)
    held = lake_rows(backup).num_rows
    shutil.rmtree(lake)
    shutil.copytree(backup, lake)
    assert 0 < lake_rows(lake).num_rows == held < len(wal_events(node_dir))
    return node_dir, lake, n


def test_a_lake_restored_behind_the_realtime_worker_gets_every_entry_once(tmp_path: Path) -> None:
    """The node restarts with realtime ON against a lake copied back from a backup: its worker finds the lake's
    mark below the last record it delivered and hands over with ``Stop(target_behind)`` carrying that record;
    the daemon turns ACTIVE, moves back to the lake's mark, hard-links the segments back from the archive and
    lands them again; the node's try-start (``realtime_cdc = true``) then takes over, and every WAL entry,
    those written after the restart too, is in the lake exactly once."""
    node_dir, lake, n = restored_lake_behind_realtime(tmp_path)
    before = rewinds()
    node = open_node(node_dir, lake)
    try:
        stops = dict(node.realtime.stops)
        realtime_on(node, node_dir, lake)
        n = write(node, n, 20)
        delivered_all(node, node_dir)
    finally:
        node.close()
    check_lake(lake, node_dir)
    assert stops == {"target_behind": 1}
    assert rewinds() - before == 1
    (stop,) = [m for _, m in markers(node_dir) if isinstance(m, StopRealtimeCdcRecord) and m.reason == "target_behind"]
    assert stop.delivered is not None and stop.delivered.segment > 0


def test_a_restored_lake_whose_segments_left_the_archive_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    """As above, with the archive no longer holding the segments after the lake's mark: the daemon taking over
    stops with one line (lake table, version and mark, the record the node delivered, the way forward) and lands
    nothing."""
    node_dir, lake, _n = restored_lake_behind_realtime(tmp_path)
    rows = lake_rows(lake).num_rows
    for seg, path in archived_segments(node_dir).items():
        if seg < 3:
            path.unlink()  # archive retention took them
    node = open_node(node_dir, lake)
    try:
        assert node.realtime.stops.get("target_behind") == 1
        with daemon(node_dir, lake) as d, pytest.raises(TargetBehind) as err:
            d.sync_once()
    finally:
        node.close()
    line: Any = str(err.value)
    assert f"lake table {lake / 'changes'} at version" in line and "holds node" in line
    assert "delivered up to record" in line and "neither linked" in line
    assert lake_rows(lake).num_rows == rows, "nothing landed past the loss"


def test_a_lake_replaced_while_the_realtime_worker_delivers_is_landed_again_by_the_daemon(tmp_path: Path) -> None:
    """The lake copied back from a backup under a running node: the worker's next batch finds the mark gone back
    (``LakeBehind``) and realtime stops with ``consumer_error``; the daemon taking over at that Stop asks the lake
    with the record the node delivered, moves back to the mark and lands the lost records again: every WAL entry
    once."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "lake-backup"
    before = rewinds()
    node = open_node(node_dir, lake)
    try:
        realtime_on(node, node_dir, lake)
        n = write(node, 0, 40)
        delivered_all(node, node_dir)
        shutil.copytree(lake, backup)
        n = write(node, n, 40)
        delivered_all(node, node_dir)
        shutil.rmtree(lake)
        shutil.copytree(backup, lake)
        write(node, n, 10)
        # The stop counts once its Stop record is durable (the mode goes OFF before): the record the daemon needs.
        wait_for(lambda: node.realtime.stops, 60, "realtime to stop at the lake's lost commits")
        assert node.realtime.stops == {"consumer_error": 1} and node.realtime.mode is RealtimeMode.OFF
        node.force_archive()  # the Stop record, for the daemon
        with daemon(node_dir, lake) as d:
            d.sync_once()
            assert d.state.mode is CdcMode.DAEMON_ACTIVE
    finally:
        node.close()
    with daemon(node_dir, lake) as d:
        d.sync_once()
    check_lake(lake, node_dir)
    assert rewinds() - before == 1
