"""Maintenance that expects neighbours (issue 29 item 4): two `cdcd run` daemons, each following its own node
and keeping scheduled compaction and OPTIMIZE of ONE lake, run side by side under load. Their runs collide
(Delta's concurrent-modification conflicts); those are retried, never counted as failures, so neither daemon
exits, and the lake's `changes` ends with each node's WAL exactly once, entry by entry. The 10-minute run
is `make chaos`'s `lake-neighbours` scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.neighbours import run_neighbours

RUN_S = 45.0


@pytest.mark.timeout(1800)  # two JVMs, then compact and verify: minutes on a loaded 2-core machine
def test_two_daemons_with_scheduled_maintenance_on_one_lake_never_exit(tmp_path: Path) -> None:
    run = run_neighbours(tmp_path, RUN_S, pause_ms=1000)  # volume is not the point: the collisions are
    assert all(compacted >= 1 and compacted + optimized >= 2 for compacted, optimized in run.runs), run.runs
    print(
        f"\ntwo daemons {RUN_S:.0f} s under load: (compactions, optimizations) {run.runs}, {run.conflicts} "
        f"conflicts retried, {run.failures} real failures, {run.entries} entries landed once"
    )
