"""Scenario: daemons that keep one lake side by side (issue 29 item 4). Three nodes under load, one `cdcd run`
each, landing into ONE lake with scheduled compaction and OPTIMIZE every few seconds in every daemon, for 10
minutes (90 s with ``--short``): their maintenance runs collide, the conflicts are retried, no daemon exits, and
the lake ends with every node's WAL exactly once (``tests/support/neighbours.py``)."""

from __future__ import annotations

from tests.support.chaos import Ctx, Result, check
from tests.support.neighbours import run_neighbours


def lake_neighbours(ctx: Ctx, res: Result) -> None:
    """Three daemons' scheduled maintenance on one lake for 10 minutes under load: no exit, exactly once."""
    res.duplicates_must_be_zero = True
    run_s = ctx.pick(90.0, 600.0)
    run = run_neighbours(ctx.episode_dir("run"), run_s, daemons=3)
    check(all(c >= 3 and o >= 3 for c, o in run.runs), f"too few maintenance runs in {run_s:.0f} s: {run.runs}")
    res.runs += 1
    res.written += run.entries
    res.delivered += run.entries
    res.details.update(maintenance_runs=run.runs, conflicts=run.conflicts, failures=run.failures, run_s=run_s)
    ctx.log(f"{run_s:.0f} s: runs {run.runs}, {run.conflicts} conflicts retried, {run.failures} real failures")
