"""Scenario 2: the daemon frozen with SIGSTOP for 0.5-3 s at random moments while the node keeps writing, then
SIGCONT; the last stall ends with a SIGTERM sent while it is frozen (it must still stop cleanly, exit 0).

No process dies, so the daemon's JSON-lines file must be exactly the WAL's data entries, in order, with no
duplicate; after each stall the daemon must catch up with what the node wrote meanwhile.
"""

from __future__ import annotations

import signal
import time

from tests.support.chaos import Ctx, Result, check, check_exact, rig
from tests.support.procs import stop_daemon, wait_for
from tests.support.wal import archived_segments


def sigstop_daemon(ctx: Ctx, res: Result) -> None:
    """SIGSTOP/SIGCONT the daemon (stalls of 0.5-3 s) while the node writes: exact delivery, no duplicate."""
    res.duplicates_must_be_zero = True
    episodes = ctx.pick(1, 2)
    stalls = ctx.pick(3, 8)
    longest = catchup_max = 0.0
    for ep in range(episodes):
        tmp = ctx.episode_dir(f"ep{ep}")
        with rig(tmp, realtime_cdc=False) as r:
            r.start_node(pause_ms=20, every=ctx.pick(4, 10))  # ~8k / ~20k entries/s
            r.start_daemon()
            r.wait_mode("off", "ACTIVE")
            for k in range(stalls):
                time.sleep(ctx.rng.uniform(0.1, 0.8))
                assert r.daemon is not None
                pid = r.daemon.pid
                before = r.status()["last_archived_segment"]
                stall = ctx.rng.uniform(0.5, 3.0)
                r.daemon.send_signal(signal.SIGSTOP)
                time.sleep(stall)
                after = r.status()["last_archived_segment"]
                check(after > before, f"the node archived nothing during a {stall:.1f}s stall ({before} -> {after})")
                last = k == stalls - 1
                if last:
                    r.daemon.send_signal(signal.SIGTERM)  # queued while frozen
                r.daemon.send_signal(signal.SIGCONT)
                res.runs += 1
                longest = max(longest, stall)
                if last:
                    rc = r.daemon.wait(30)
                    check(rc == 0, f"SIGTERM while stopped, then SIGCONT: exit {rc}: {r.tail(r.daemon_err)}")
                    r.daemon = None
                    break
                t0 = time.monotonic()
                until = (after + 1, 0, 0)

                def caught_up(until: tuple[int, int, int] = until, pid: int = pid) -> bool:
                    check(r.daemon is not None and r.daemon.poll() is None, f"daemon {pid} died after SIGCONT")
                    pos = r.daemon_position()
                    return isinstance(pos, tuple) and pos >= until

                wait_for(caught_up, 60, f"the daemon to pass segment {after} after SIGCONT", interval=0.1)
                catchup_max = max(catchup_max, time.monotonic() - t0)
            r.start_daemon()
            time.sleep(0.5)
            r.stop_node()
            r.wait_daemon_caught_up()
            check(r.daemon is not None, "daemon gone")
            assert r.daemon is not None
            rc = stop_daemon(r.daemon)
            check(rc == 0, f"daemon exit {rc}: {r.tail(r.daemon_err)}")
            r.daemon = None
            d = r.delivery()
            res.add(d)
            d.check_clean(f"ep{ep}")
            check_exact(r)
            check(len(archived_segments(r.node_dir)) > 20, "too few segments for a meaningful run")
    res.notes.append(f"longest stall {longest:.1f}s; catch-up after SIGCONT at most {catchup_max:.1f}s")
    res.details.update({"longest_stall_s": round(longest, 2), "max_catchup_s": round(catchup_max, 2)})
