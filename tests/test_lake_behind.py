"""A lake behind the daemon's committed position (issue 28): restored from a backup, or missing its newest
``changes`` commit. The daemon compares the lake's mark of its node with the last record it delivered
(``DaemonState.last_delivered``) at start and lands again what the lake lost, from the CDC dir's links or the
node's archive; without those segments it stops with one line (exit 9), never going on past the loss. The
reference is the WAL: ``check_lake`` wants every entry in the lake exactly once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from deltalake import DeltaTable
from prometheus_client import REGISTRY

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon_state import CdcMode, StateStore
from cdcd.faults import ExitCode
from cdcd.lake.landing.arrow import key_to_json
from cdcd.lake.landing.delta import app_id, decode_version
from cdcd.lake.maintenance.compact import compact, compacted_version, state_lag, table_version
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.node.identity import read_node_id
from cdcd.node.snapshot import NodeSnapshot
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import check_lake, delta_commits, lake_consumer, lake_rows
from tests.support.delta_tables import state_rows
from tests.support.lake import error_lines, run_to_end, write_config
from tests.support.procs import cdcd, log_events, run_daemon_until_exit
from tests.support.wal import archived_segments, cdc_links, wal_events
from tests.support.writer import make_node


def rewinds() -> float:
    return REGISTRY.get_sample_value("cdcd_daemon_rewinds_total") or 0.0


def relinked() -> float:
    return REGISTRY.get_sample_value("cdcd_daemon_relinked_segments_total") or 0.0


def sync(node_dir: Path, lake: Path) -> int:
    """One in-process daemon pass over everything the CDC dir holds (real WAL, LMDB state and Delta table)."""
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer=lake_consumer(lake))
    with Daemon(config, LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))) as daemon:
        assert daemon.state.mode is CdcMode.DAEMON_ACTIVE
        return daemon.sync_once()


def node_keys(node_dir: Path) -> set[tuple[str, str]]:
    """(cache, key as the lake's key text) of every entry the (stopped) node holds."""
    with NodeSnapshot(node_dir) as snap:
        return {(cache, key_to_json(key)) for cache in snap.caches() for key, _ in snap.raw_items(cache)}


def last_delivered(node_dir: Path) -> tuple[int, int] | None:
    store = StateStore(node_dir / "cdcd-state", readonly=True)
    try:
        ptr = store.load(CdcMode.DAEMON_ACTIVE).last_delivered
    finally:
        store.close()
    return (ptr.segment, ptr.offset) if ptr is not None else None


def test_a_lake_restored_from_a_backup_gets_what_came_after_again(tmp_path: Path) -> None:
    """The lake copied back from a backup taken mid-run: the daemon's position is past the lake's mark. At its
    next start it moves back to the mark, hard-links the consumed segments back from the node's archive, and
    every WAL entry is in the lake exactly once; the rewind is counted and logged."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "lake-backup"
    n = make_node(node_dir, segments=2, tx_per_segment=20)
    assert sync(node_dir, lake) > 0
    shutil.copytree(lake, backup)
    held = lake_rows(lake).num_rows
    make_node(node_dir, segments=3, tx_per_segment=20, first_tx=n)
    assert sync(node_dir, lake) > 0
    check_lake(lake, node_dir)
    assert not cdc_links(node_dir), "every consumed link deleted"
    shutil.rmtree(lake)
    shutil.copytree(backup, lake)
    assert lake_rows(lake).num_rows == held < len(wal_events(node_dir))
    before, before_links = rewinds(), relinked()
    sync(node_dir, lake)
    check_lake(lake, node_dir)
    assert last_delivered(node_dir) == tuple(wal_events(node_dir)[-1]["pos"][:2])
    assert rewinds() - before == 1
    assert relinked() - before_links == 4, "the mark's segment (1) and 2..4, from the archive"
    # Caught up: the next start compares again and finds nothing to do.
    assert sync(node_dir, lake) == 0
    assert rewinds() - before == 1


def test_the_newest_changes_commit_deleted_lands_again(tmp_path: Path) -> None:
    """``cdcd run`` against a lake whose newest ``_delta_log`` commit was deleted after the daemon committed past
    it: the restarted daemon logs a warning and lands that commit's records again, exactly once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=4, tx_per_segment=20)
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=500)
    run_to_end(config, node_dir, tmp_path / "run1.err")
    commits = delta_commits(lake)
    assert len([c for c in commits if c["adds"]]) > 1
    newest = lake / "changes" / "_delta_log" / f"{commits[-1]['version']:020d}.json"
    lost = commits[-1]["cdcd"]["rows"]
    newest.unlink()
    assert lake_rows(lake).num_rows == len(wal_events(node_dir)) - lost
    run_to_end(config, node_dir, tmp_path / "run2.err")
    check_lake(lake, node_dir)
    (warning,) = [e for e in log_events(tmp_path / "run2.err") if e["event"] == "target_behind_relanding"]
    assert warning["level"] == "warning" and warning["delivered"] == "{}:{}".format(*wal_events(node_dir)[-1]["pos"])


def test_a_restored_lake_whose_segments_are_gone_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    """The lake restored from a backup, and the node's archive no longer holds the segments after the lake's
    mark: ``cdcd run`` exits 9 with one line naming the lake, its version, its mark, the daemon's position and
    the way on; it lands nothing and commits nothing."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "lake-backup"
    n = make_node(node_dir, segments=2, tx_per_segment=20)
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake))
    run_to_end(config, node_dir, tmp_path / "run1.err")
    shutil.copytree(lake, backup)
    make_node(node_dir, segments=2, tx_per_segment=20, first_tx=n)
    run_to_end(config, node_dir, tmp_path / "run2.err")
    shutil.rmtree(lake)
    shutil.copytree(backup, lake)
    version = len(delta_commits(lake)) - 1
    for seg, path in archived_segments(node_dir).items():
        if seg < 3:
            path.unlink()  # archive retention took them
    store = StateStore(node_dir / "cdcd-state", readonly=True)
    state = store.load(CdcMode.DAEMON_ACTIVE)
    store.close()
    err = tmp_path / "run3.err"
    assert run_daemon_until_exit(config, err, timeout=120) == ExitCode.TARGET_BEHIND
    (line,) = error_lines(err.read_text())
    node_id = str(read_node_id(node_dir))
    mark = decode_version(DeltaTable(str(lake / "changes")).transaction_version(app_id(node_id, 0)))
    assert f"lake table {lake / 'changes'} at version {version} holds node {node_id} up to record {mark}" in line
    assert f"delivered up to record {state.last_delivered}" in line
    assert f"committed position {state.position}" in line
    assert "cdcd state reset" in line and "cdcd control resend" in line
    assert len(delta_commits(lake)) == version + 1, "nothing landed"
    store = StateStore(node_dir / "cdcd-state", readonly=True)
    assert store.load(CdcMode.DAEMON_ACTIVE) == state, "nothing committed"
    store.close()


def test_compaction_folds_a_reused_changes_version_in(tmp_path: Path, spark: Any) -> None:
    """The newest ``changes`` commit deleted after ``state`` compacted it, and the node writes on: the daemon lands
    the lost records again together with new ones, in a commit that takes the deleted one's version number. The
    next compaction sees that ``state``'s version now names another commit, folds it in, and ``cdcd lake verify``
    finds state equal to the node's caches."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    n = make_node(node_dir, segments=3, tx_per_segment=15)
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=700)
    run_to_end(config, node_dir, tmp_path / "run1.err")
    first = compact(spark, lake, typed_tables=False)
    reused = first.to_version
    assert compacted_version(lake) == reused and not state_lag(lake)[2]
    (lake / "changes" / "_delta_log" / f"{reused:020d}.json").unlink()
    make_node(node_dir, segments=2, tx_per_segment=15, first_tx=n)
    run_to_end(config, node_dir, tmp_path / "run2.err")
    check_lake(lake, node_dir)
    assert state_lag(lake)[2], "state is behind: the version it names holds other records now"
    again = compact(spark, lake, typed_tables=False)
    assert again.from_version == reused and again.to_version == table_version(lake / "changes")
    assert compacted_version(lake) == again.to_version and not state_lag(lake)[2]
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # Nothing replaced any more: the next compaction has nothing to do.
    assert not compact(spark, lake, typed_tables=False).did_work


def test_keys_of_a_restored_nodes_lost_history_leave_state(tmp_path: Path, spark: Any) -> None:
    """A node dir (with its daemon state) restored from a backup, after the lost history wrote keys the restored
    node never writes and had been compacted into ``state``: the lake lands the restored node's writes as a new
    generation, and the next compaction rebuilds ``state`` and the typed tables without the lost history's rows.
    ``cdcd lake verify`` then finds every cache equal to the node, keys of the lost history gone."""
    node_dir, lake, backup = tmp_path / "node", tmp_path / "lake", tmp_path / "node-backup"
    n = make_node(node_dir, segments=2, tx_per_segment=15)
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake))
    run_to_end(config, node_dir, tmp_path / "run1.err")
    shutil.copytree(node_dir, backup)
    make_node(node_dir, segments=2, tx_per_segment=15, first_tx=n)  # the history the restore loses
    run_to_end(config, node_dir, tmp_path / "run2.err")
    compact(spark, lake)
    lost_keys = set(state_rows(lake))
    shutil.rmtree(node_dir)
    shutil.copytree(backup, node_dir)
    make_node(node_dir, segments=2, tx_per_segment=15, first_tx=n + 2000)
    run_to_end(config, node_dir, tmp_path / "run3.err")
    assert DeltaTable(str(lake / "changes")).transaction_version(app_id(str(read_node_id(node_dir)), 1)) is not None
    only_lost = lost_keys - node_keys(node_dir)
    assert only_lost, "the lost history wrote keys the restored node does not have"
    result = compact(spark, lake)
    assert result.from_version == 0, "rebuilt from the first changes version"
    assert not state_lag(lake)[2]
    assert not (set(state_rows(lake)) & only_lost)
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not compact(spark, lake).did_work, "rebuilt once"
