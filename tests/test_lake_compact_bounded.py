"""A compaction folds at most ``compact_max_rows`` change rows (whole commits), leaves the rest for the next run,
and the Maintainer runs that next one at once: a run's cost follows the bound, not the backlog, and the runs
together fold exactly what one unbounded compaction folds."""

from __future__ import annotations

import shutil
from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.maintenance.compact import compact, compacted_version
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.table import CHANGES, STATE
from cdcd.lake.typed.layout import list_tables
from tests.support.delta_lake import sub_batch, wal_batch
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import wait_for
from tests.support.writer import make_node


def _commits(lake: Path, commits: int, rows_per_commit: int) -> list[dict[str, object]]:
    """``commits`` commits of ``rows_per_commit`` changes each over two caches, keys reused (updates, deletes)."""
    rows: list[dict[str, object]] = []
    order = 0
    for i in range(commits):
        batch = []
        for j in range(rows_per_commit):
            order += 1
            key = str((i * 7 + j) % 23)
            value = None if order % 11 == 0 else f'{{"n": {order}}}'
            batch.append(change(("orders", "users")[j % 2], key, value, order))
        append_changes(lake, batch)
        rows += batch
    return rows


def _typed_keys(lake: Path) -> dict[str, list[int]]:
    return {
        cache: sorted(DeltaTable(str(path)).to_pyarrow_table(columns=["key"]).column("key").to_pylist())
        for cache, path in list_tables(lake).items()
    }


def test_each_run_folds_whole_commits_up_to_the_bound_and_the_runs_fold_what_one_would(tmp_path: Path) -> None:
    bounded, whole = tmp_path / "bounded", tmp_path / "whole"
    rows = _commits(bounded, commits=7, rows_per_commit=10)
    _commits(whole, commits=7, rows_per_commit=10)
    end = DeltaTable(str(bounded / CHANGES)).version()
    compact(None, whole)

    folded: list[tuple[int, int]] = []
    while True:
        result = compact(None, bounded, max_rows_per_run=25)  # two commits of 10 fit, a third does not
        if not result.did_work:
            break
        folded.append((result.from_version, result.to_version))
        assert result.behind == (result.to_version < end)
        assert compacted_version(bounded) == result.to_version
    assert folded == [(0, 1), (2, 3), (4, 5), (6, 6)]
    assert state_rows(bounded) == state_rows(whole) == expected_state(rows)
    assert _typed_keys(bounded) == _typed_keys(whole)


def test_a_commit_larger_than_the_bound_is_folded_alone(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows = _commits(lake, commits=3, rows_per_commit=40)
    result = compact(None, lake, max_rows_per_run=25)
    assert (result.from_version, result.to_version, result.behind) == (0, 0, True)
    while compact(None, lake, max_rows_per_run=25).did_work:
        pass
    assert compacted_version(lake) == 2
    assert state_rows(lake) == expected_state(rows)


def test_the_maintainer_runs_the_next_compaction_at_once_while_one_left_changes_behind(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    rows = _commits(lake, commits=6, rows_per_commit=10)
    runs: list[tuple[int, int, bool]] = []
    waiting: list[set[str]] = []
    """The new caches still waiting to be reported ready when each run starts."""

    def bounded(session: object, path: Path) -> object:
        waiting.append(set(maintainer._new_caches))
        result = compact(None, path, max_rows_per_run=10)
        runs.append((result.from_version, result.to_version, result.behind))
        return result

    # The first run comes because a cache landed for the first time (due a second later); the other five only
    # because each left changes behind: at the interval's pace they would take hours.
    options = MaintainerOptions(compact_interval_s=3600, optimize_interval_s=0)
    maintainer = Maintainer(lake, None, options, compact_fn=bounded)
    maintainer.start()
    maintainer.landed({"orders": 30, "users": 30})
    try:
        wait_for(lambda: compacted_version(lake) == 5, timeout=120, what="six bounded runs, one after the other")
        wait_for(lambda: maintainer.compactions >= 6, timeout=60, what="the sixth run's end")
    finally:
        maintainer.stop()
    assert runs[:6] == [(v, v, v < 5) for v in range(6)]
    # The new caches are reported ready by the run that left nothing behind, not by the first (10 rows folded).
    assert waiting[:6] == [{"orders", "users"}] * 6
    assert maintainer._new_caches == {}
    assert state_rows(lake) == expected_state(rows)
    assert (lake / STATE).is_dir()


def test_the_sink_s_compact_max_rows_bounds_each_scheduled_run(tmp_path: Path) -> None:
    """``compact_max_rows = 1``: every commit of changes is a compaction run of its own, one after the other, and
    the lake ends where one compaction of the same changes ends."""
    node_dir, lake, copy = tmp_path / "node", tmp_path / "lake", tmp_path / "copy"
    make_node(node_dir, segments=2, tx_per_segment=10)
    batch = wal_batch(node_dir, "test-node")
    options = LakeOptions(
        lake_path=str(lake),
        writer="deltalake",
        compact_interval_s=3600,  # the first run because new caches landed; the rest because runs left changes
        optimize_interval_s=0,
        compact_max_rows=1,
    )
    sink = LakeConsumer(options)
    sink.start()
    try:
        for k in range(0, len(batch.peek_slices()), 5):
            assert sink.on_events(sub_batch(batch, k, k + 5)) is True
        end = DeltaTable(str(lake / CHANGES)).version()
        maintainer = sink._maintainer
        assert maintainer is not None

        def folded_to_end() -> bool:
            last = maintainer.last_compact
            return last is not None and last.to_version == end

        wait_for(folded_to_end, timeout=300, what="the bounded runs up to the last commit")
        assert maintainer.last_compact is not None and not maintainer.last_compact.behind
        assert compacted_version(lake) == end
        assert maintainer.compactions >= 4, "one run per batch of changes (4 batches), not one for all"
    finally:
        sink.stop()
    shutil.copytree(lake / CHANGES, copy / CHANGES)
    compact(None, copy)
    assert state_rows(lake) == state_rows(copy)
    assert _typed_keys(lake) == _typed_keys(copy)
