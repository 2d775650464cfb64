"""The bound's rewrite off the delivery path (issue 43 items 1 and 4, cdcd/lake/maintenance/autocompact.py
``Rewriter``): the rewrite a commit makes due runs in a thread of its own while the sink builds and writes its
next batch, and the next commit waits for it. Checked on the table's log, version by version: files per
partition within the bound at every version, every rewrite committed right after the commit that made it due
(the version it read plus one: nothing came between), no commit conflict; the next batch's files written while
a rewrite is held and committed only after it; and a SIGKILL while a rewrite is held leaves only orphan files
(the rewrite's merged file, the next batch's files) and, run again, every WAL entry exactly once."""

from __future__ import annotations

import itertools
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cdcd import metrics
from cdcd.lake.table import CHANGES
from tests.support.delta_lake import check_moment, land_each_record, record_sizes, wal_batch
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
from tests.support.procs import reap, start_held_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node

BOUND = 6
"""``max_files_per_partition`` here: small, so every tier is rewritten again and again."""
HELD = "lake.autocompact.written"
"""The fail point a rewrite is held at: its merged files written and fsynced, not committed."""


def _check_sequence(log: list[Version]) -> None:
    """Every rewrite is the version right after a batch's commit and rewrites only partitions that commit
    touched (it read that version and committed at the next: nothing came between); no commit moved a mark
    it did not land files for."""
    assert log, "no commits"
    for prev, v in itertools.pairwise(log):
        if v.rewrite:
            assert not prev.rewrite and prev.marks, f"rewrite {v.version} does not follow a batch's commit"
            assert v.partitions_removed <= prev.partitions_added, (v.version, v.partitions_removed)
            assert not v.marks, f"rewrite {v.version} moved a mark"
    assert [v.version for v in log] == list(range(len(log))), "a gap in the log"


def test_every_version_is_within_the_bound_and_each_rewrite_commits_right_after_its_batch(tmp_path: Path) -> None:
    """The sink (JVM-free writer, bound 6) lands a node's records one batch each: at every version of the log,
    rewrites included, no partition holds more than 6 files; each rewrite is the version after the batch that
    made it due; no commit of the sink lost to its own rewrite (no conflict, no retry); the table holds every
    WAL entry exactly once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=3, tx_per_segment=40)
    batch = wal_batch(node_dir)
    conflicts0 = metrics.LAKE.get_sample_value("cdcd_lake_log_conflicts_total") or 0.0
    sink = land_each_record(lake, batch, max_files=BOUND)
    n = len(batch.peek_slices())
    table = sink._table
    assert table is not None
    assert table.conflicts == 0, "a batch's commit lost to a rewrite: it did not wait for it"
    assert (metrics.LAKE.get_sample_value("cdcd_lake_log_conflicts_total") or 0.0) == conflicts0
    log = versions(lake / CHANGES)
    _check_sequence(log)
    assert sum(v.rewrite for v in log) >= 20, "too few rewrites to say anything"
    assert sum(1 for v in log if v.marks) == n, "one commit per batch"
    over = [(v, most) for v, most in most_files_at_every_version(lake / CHANGES) if most > BOUND]
    assert not over, f"versions over the bound of {BOUND}: {over[:5]}"
    same_rows_as_wal(lake, wal_events(node_dir))


# --- the daemon, a rewrite held at its fail point ------------------------------------------------------------
def _held_daemon(tmp_path: Path, node_dir: Path, lake: Path) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    """``cdcd run`` over a backlog (JVM-free writer, bound 6, batches of 40 records) whose second rewrite holds
    at ``HELD``; returns once it holds and the next batch's files are written (the sink built and wrote them
    while the rewrite ran). (process, its config, its stderr, the hold's marker: delete it to go on)."""
    make_node(node_dir, segments=6, tx_per_segment=30)
    consumer = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", "max_files_per_partition": BOUND}
    config = write_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=400)
    proc, err, marker = start_held_daemon(config, tmp_path, HELD, "@2=pause")  # the second rewrite, held
    wait_for(lambda: _batch_written(lake) or proc.poll() is not None, 120, "the next batch's files, written meanwhile")
    assert proc.poll() is None, err.read_text()[-3000:]
    return proc, config, err, marker


def _batch_written(lake: Path) -> bool:
    """Whether an orphan of ``changes`` holds records not landed (a batch's files, written, not committed)."""
    try:
        return bool(split_orphans(lake)[1])
    except (OSError, ValueError):  # a file being written this very moment (pyarrow: ArrowInvalid): look again
        return False


@pytest.mark.timeout(600)
def test_the_next_batch_is_written_while_a_rewrite_runs_and_committed_after_it(tmp_path: Path) -> None:
    """While the second rewrite is held (its merged file written, not committed), the daemon writes its next
    batch's files but commits nothing; let go, the rewrite commits at the version it read plus one and the
    batch after it; to the end every version is within the bound, nothing conflicted and every WAL entry landed
    exactly once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    proc, config, err, marker = _held_daemon(tmp_path, node_dir, lake)
    try:
        held_at = versions(lake / CHANGES)[-1]
        assert held_at.marks and not held_at.rewrite, "the rewrite held is the one the newest batch made due"
        time.sleep(1.0)  # room for a commit that does not wait to show up (one that waits never does)
        assert versions(lake / CHANGES)[-1].version == held_at.version, "a commit went ahead of the held rewrite"
        marker.unlink()
        wait_caught_up(proc, config, node_dir, err, 300)
    finally:
        rc = stop_daemon(proc, timeout=60)
        reap(proc)
    text = err.read_text()
    assert rc == 0, text[-3000:]
    log = versions(lake / CHANGES)
    after = log[held_at.version + 1]
    assert after.rewrite, "the held rewrite committed at the version it read plus one"
    assert log[held_at.version + 2].marks, "the batch written meanwhile committed right after it"
    _check_sequence(log)
    for event in ("lake_autocompact_lost", "lake_commit_conflict", "lake_autocompact_failed"):
        assert event not in text, event
    over = [(v, most) for v, most in most_files_at_every_version(lake / CHANGES) if most > BOUND]
    assert not over, f"versions over the bound of {BOUND}: {over[:5]}"
    same_rows_as_wal(lake, wal_events(node_dir))


@pytest.mark.timeout(600)
def test_sigkill_while_a_rewrite_runs_leaves_only_orphans_and_every_entry_once(tmp_path: Path) -> None:
    """SIGKILLed while the second rewrite is held and the next batch's files are written: the log holds neither
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
