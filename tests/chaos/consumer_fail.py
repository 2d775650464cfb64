"""Scenario 7: a consumer that raises (``chaos_sinks:FailOnTrigger``, while a trigger file exists) under live load.

Each round: the daemon runs, the trigger appears at a random moment, the next batch raises -- either before writing
anything (``before``) or after writing and fsyncing the whole batch without confirming it (``after``). The daemon
must exit 4 with exactly one ``cdcd: error: consumer on_events() raised RuntimeError: injected consumer failure``
line (the last on stderr) and one ``consumer_failed`` log line, and its committed position must be exactly the end
of what was confirmed: every WAL entry before it delivered in a confirmed batch, none of the failing batch. Then
the trigger is removed ("fixed") and the next round restarts the daemon. At the end everything is delivered
exactly: the restarted runs begin at the committed position, and the only duplicates are the failing batches
written in ``after`` rounds -- exactly as many as they held.
"""

from __future__ import annotations

import bisect
import json
import time
from typing import Any

from tests.support.chaos import Ctx, Pos, Result, archived_positions, check, check_exact, committed_or_none, rig
from tests.support.config import write_daemon_config
from tests.support.procs import log_events
from tests.support.realtime import DAEMON_SETTINGS, read_runs

ERROR = "cdcd: error: consumer on_events() raised RuntimeError: injected consumer failure"


def consumer_raises(ctx: Ctx, res: Result) -> None:
    """A consumer raising on a trigger: exit 4, one error line, position = what was confirmed; fixed, the rest exact."""
    rounds = ctx.pick(2, 6)
    tmp = ctx.episode_dir("ep0")
    trigger, calls = tmp / "fail.trigger", tmp / "calls.jsonl"
    expected_dups = 0
    modes: list[str] = []
    with rig(tmp, realtime_cdc=False) as r:
        r.start_node(pause_ms=20, every=ctx.pick(4, 10))  # ~8k / ~20k entries/s
        for k in range(rounds):
            when = ("before", "after")[k % 2]
            options = {"path": str(r.daemon_out), "trigger": str(trigger), "calls": str(calls), "when": when}
            consumer = {"kind": "python", "class": "chaos_sinks:FailOnTrigger", "options": options}
            write_daemon_config(r.daemon_config, r.node_dir, consumer, **DAEMON_SETTINGS)
            r.start_daemon()
            err = r.daemon_err
            time.sleep(ctx.rng.uniform(0.3, 1.5))
            trigger.touch()
            rc = r.daemon_exit(30)
            text = err.read_text()
            check(rc == 4, f"round {k}: daemon exit {rc}, expected 4: {text[-1500:]}")
            lines = r.error_lines()
            check(lines == [ERROR], f"round {k}: error lines {lines}")
            check(text.rstrip("\n").splitlines()[-1] == ERROR, f"round {k}: the error line is not the last on stderr")
            failed = [e for e in log_events(err) if e.get("level") == "error"]
            check([e["event"] for e in failed] == ["consumer_failed"], f"round {k}: error log lines {failed}")

            # The committed position is exactly the end of the confirmed batches.
            position = committed_or_none(r.daemon_config)
            check(position is not None, f"round {k}: nothing committed")
            assert position is not None
            size = r.daemon_out.stat().st_size
            runs = read_runs(r.daemon_out, [*r.daemon_cuts, size])
            delivered = {tuple(e["pos"]) for run in runs for e in run}
            this_run = {tuple(e["pos"]) for e in runs[-2]}  # the run that just failed (runs[-1] is empty)
            calls_log = [json.loads(line) for line in calls.read_text().splitlines()]
            last_call = calls_log[-1]
            check(last_call["ok"] is False, f"round {k}: the last consumer call did not fail: {last_call}")
            wal = archived_positions(r.node_dir)

            def entries(call: dict[str, Any], wal: list[Pos] = wal) -> set[Pos]:
                first, last = tuple(call["first"]), tuple(call["last"])
                return set(wal[bisect.bisect_left(wal, first) : bisect.bisect_right(wal, last)])

            failing = entries(last_call)
            check(len(failing) == last_call["events"], f"round {k}: failing batch {last_call} vs WAL {len(failing)}")
            if when == "after":
                check(failing <= this_run, f"round {k}: the failing batch was not written before the raise")
                expected_dups += len(failing)
            else:
                check(not failing & this_run, f"round {k}: entries of the failing batch were written")
            confirmed: set[Pos] = set().union(*(entries(c) for c in calls_log if c["ok"]))
            check(confirmed <= delivered, f"round {k}: confirmed entries missing from the file")
            before = set(wal[: bisect.bisect_left(wal, position)])
            check(
                before == confirmed,
                f"round {k} ({when}): committed {position} covers {len(before)} entries, "
                f"{len(confirmed)} were confirmed ({len(before - confirmed)} never confirmed, "
                f"{len(confirmed - before)} confirmed but not committed)",
            )
            r.daemon_cuts.append(size)
            r.daemon_resumes.append(position)
            trigger.unlink()
            modes.append(when)
            res.runs += 1
        r.start_daemon()
        time.sleep(ctx.rng.uniform(0.3, 1.0))
        r.stop_node()
        r.wait_daemon_caught_up()
        r.stop_daemon()
        d = r.delivery()
        res.add(d)
        d.check_clean("consumer-raises")
        check_exact(r)
        check(
            d.duplicates == expected_dups,
            f"{d.duplicates} duplicates, expected exactly the {expected_dups} entries of the 'after' failing batches",
        )
    res.notes.append(f"rounds {modes}; duplicates = the failing batches written before raising ({expected_dups})")
