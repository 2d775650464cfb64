"""Maintenance that expects neighbours (issue 29 item 4): two `cdcd run` daemons, each following its own node
and compacting ONE lake every second, run side by side under load until their compactions collide for real (a
run loses to the neighbour's commit: retried as a conflict, or recognised as done by the neighbour, which folded
the same changes). Neither daemon exits, no failure is counted, and the lake's `changes` ends with each node's
WAL exactly once, entry by entry, `lake verify` OK. The 10-minute run with three daemons, OPTIMIZE as well, their
progress and the compaction lag is `make chaos`'s `lake-neighbours` scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.neighbours import run_neighbours


@pytest.mark.chaos  # tests/test_lake_maintainer.py loses a compaction to a neighbour's conflicting commit and to one
# that folded the same changes, at chosen points; test_lake_delta.py lands two processes' commits on one lake
@pytest.mark.timeout(1800)  # two JVMs, then compact and verify: minutes on a loaded 2-core machine
def test_two_daemons_with_scheduled_maintenance_on_one_lake_never_exit(tmp_path: Path) -> None:
    # Compaction every second in both: their runs overlap, so one soon loses to the other's commit. OPTIMIZE
    # (minutes per run on two busy cores) beside them is the chaos scenario's.
    run = run_neighbours(
        tmp_path, 0.0, pause_ms=2000, until_collision=True, compact_interval_s=1.0, optimize_interval_s=0.0
    )
    collisions = run.conflicts + sum(compactions for compactions, _ in run.by_neighbour)
    assert collisions >= 1 and run.failures == 0, (run.conflicts, run.by_neighbour, run.failures)
    assert all(compactions >= 1 for compactions, _ in run.progress), run
    print(
        f"\ntwo daemons: (compactions, optimizations) own {run.runs}, done by a neighbour {run.by_neighbour}, "
        f"{run.conflicts} conflicts retried, {run.failures} real failures, {run.entries} entries landed once, "
        f"lag at most {run.max_lag_s:.0f} s"
    )
