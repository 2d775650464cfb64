"""Checkpoints of ``changes`` off the writer's commit path (cdcd/lake/landing/checkpointer.py): while the
checkpointer's thread is held about to write the first checkpoint the log made due, the daemon's sink goes on
committing batch after batch and no commit writes a checkpoint; let go, it writes one, and every WAL entry is in
the table exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from cdcd.lake.landing.checkpointer import WRITING
from cdcd.lake.table import CHANGES
from tests.support.lake import wait_caught_up, write_config
from tests.support.lake_rewrites import same_rows_as_wal
from tests.support.procs import reap, start_held_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node


def _checkpoints(changes: Path) -> list[int]:
    return sorted(int(p.name[:20]) for p in (changes / "_delta_log").glob("*.checkpoint.parquet"))


def _version(changes: Path) -> int:
    return max(int(p.name[:20]) for p in (changes / "_delta_log").glob("*.json"))


@pytest.mark.timeout(600)
def test_commits_go_on_while_a_checkpoint_is_written_and_none_writes_one(tmp_path: Path) -> None:
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    changes = lake / CHANGES
    make_node(node_dir, segments=6, tx_per_segment=40)  # 240 transactions, a commit each
    consumer = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake"}
    consumer |= {"compact_interval_s": 0, "optimize_interval_s": 0}  # only the sink commits
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=1)
    proc, err, marker = start_held_daemon(config, tmp_path, WRITING)  # the first checkpoint, held
    try:
        held_at = _version(changes)
        assert held_at >= 99
        # Commits go on: forty more versions while the checkpoint is held, none of them writing one.
        wait_for(lambda: _version(changes) >= held_at + 40 or proc.poll() is not None, 120, "commits meanwhile")
        assert proc.poll() is None, err.read_text()[-3000:]
        assert _checkpoints(changes) == [], "a commit wrote a checkpoint"
        marker.unlink()
        wait_for(lambda: _checkpoints(changes) != [], 60, "the held checkpoint, written")
        wait_caught_up(proc, config, node_dir, err, 300)
    finally:
        rc = stop_daemon(proc, timeout=60)
        reap(proc)
    text = err.read_text()
    assert rc == 0, text[-3000:]
    assert "lake_checkpoint_failed" not in text
    assert _checkpoints(changes)[0] >= 99  # the version its handle read when the checkpoint came due
    DeltaTable(str(changes)).version()  # the table opens from its checkpoint
    same_rows_as_wal(lake, wal_events(node_dir))
