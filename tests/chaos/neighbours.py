"""Scenario: daemons that keep one lake side by side (issue 29 item 4). Three nodes under load, one `cdcd run`
each, landing into ONE lake with scheduled compaction and OPTIMIZE every few seconds in every daemon, for 10
minutes (90 s with ``--short``): their maintenance runs collide; a run that loses is retried, a compaction that
lost to a neighbour folding the same changes and an OPTIMIZE due just after a neighbour's count as that daemon's
progress (recognised, logged, counted); no daemon exits, `state` never falls far behind `changes`, and the lake
ends with every node's WAL exactly once (``tests/support/neighbours.py``)."""

from __future__ import annotations

from tests.support.chaos import Ctx, Result, check
from tests.support.neighbours import run_neighbours

MIN_RUNS = 3
"""Compactions and OPTIMIZEs each daemon's maintenance must make in the run, its own or recognised neighbours'."""
MAX_LAG_S = 240.0
"""Longest a `changes` version may wait until `state` reflects it, under load (compaction every 2 s)."""


def lake_neighbours(ctx: Ctx, res: Result) -> None:
    """Three daemons' scheduled maintenance on one lake for 10 minutes under load: progress, no exit, exactly once."""
    res.duplicates_must_be_zero = True
    run_s = ctx.pick(90.0, 600.0)
    run = run_neighbours(ctx.episode_dir("run"), run_s, daemons=3)
    res.details.update(
        maintenance_runs=run.runs,
        by_neighbour=run.by_neighbour,
        conflicts=run.conflicts,
        failures=run.failures,
        max_lag_s=round(run.max_lag_s, 1),
        lag_samples=run.lag_samples,
        lag_errors=run.lag_errors[:5],
        run_s=run_s,
    )
    ctx.log(
        f"{run_s:.0f} s: own runs {run.runs}, done by a neighbour {run.by_neighbour}, {run.conflicts} conflicts "
        f"retried, {run.failures} real failures, compaction lag at most {run.max_lag_s:.0f} s "
        f"({run.lag_samples} samples)"
    )
    check(
        all(c >= MIN_RUNS and o >= MIN_RUNS for c, o in run.progress),
        f"too little maintenance progress in {run_s:.0f} s: (compactions, optimizations) own {run.runs}, "
        f"by a neighbour {run.by_neighbour}",
    )
    check(run.max_lag_s <= MAX_LAG_S, f"state fell {run.max_lag_s:.0f} s behind changes (at most {MAX_LAG_S:.0f})")
    res.runs += 1
    res.written += run.entries
    res.delivered += run.entries
