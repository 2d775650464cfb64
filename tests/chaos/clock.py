"""Scenario 5: the wall clock of the node and of the daemon jumps backwards and forwards (independently, by up to a
day) while the node writes, first with the daemon delivering, then the node in realtime mode, then the daemon again.

The clock is shifted inside the child processes by ``tests/chaos/clockpatch/sitecustomize.py`` (``time.time`` and
``time.time_ns`` plus an offset the test rewrites in a file; the monotonic clock is untouched, as when a real clock
is stepped). Both processes serve Prometheus metrics on free 127.0.0.1 ports, scraped every 100 ms: no lag metric
(gauge, histogram bucket or sum) may ever be negative, and neither may ``cdcd control status``'s lag. Nothing may
crash, and delivery must be exact (no process dies: no duplicates). The WAL's commit timestamps and the daemon's
last-commit metric must show the jumps (proof that the patch was active).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from tests.support.chaos import CLOCKPATCH, Ctx, Result, check, check_exact, rig, scrape, write_atomic_text
from tests.support.ports import free_port
from tests.support.wal import wal_events

DAY_NS = 86_400 * 10**9
HOUR_NS = 3_600 * 10**9
OFFSETS = (0, -DAY_NS, DAY_NS, -HOUR_NS, HOUR_NS, -30 * 10**9, 30 * 10**9, -3 * DAY_NS)


class Scraper(threading.Thread):
    """Scrapes the given ports every 100 ms; records every lag sample and any negative one."""

    def __init__(self, ports: dict[str, int]) -> None:
        super().__init__(name="chaos-scraper", daemon=True)
        self.ports = ports
        self.stop_event = threading.Event()
        self.scrapes = dict.fromkeys(ports, 0)
        self.errors: list[str] = []
        self.negative: list[str] = []
        self.max_lag: dict[str, float] = {}
        self.last_commit_skew_s = 0.0

    def run(self) -> None:
        while not self.stop_event.wait(0.1):
            for who, port in self.ports.items():
                try:
                    samples = scrape(port)
                except OSError as exc:
                    self.errors.append(f"{who}: {exc}")
                    continue
                self.scrapes[who] += 1
                for name, values in samples.items():
                    if "lag" not in name or name.endswith("_created"):
                        continue
                    for labels, v in values:
                        if v < 0:
                            self.negative.append(f"{who} {name}{labels} = {v}")
                        key = f"{who}:{name}"
                        self.max_lag[key] = max(self.max_lag.get(key, 0.0), v)
                for _labels, v in samples.get("cdcd_daemon_last_commit_timestamp_seconds", []):
                    if v:
                        skew = v - time.time()
                        if abs(skew) > abs(self.last_commit_skew_s):
                            self.last_commit_skew_s = skew


class Jumper(threading.Thread):
    """Every 0.2-0.8 s, a new random offset for the node's or the daemon's clock."""

    def __init__(self, ctx: Ctx, files: dict[str, Any]) -> None:
        super().__init__(name="chaos-jumper", daemon=True)
        self.rng = ctx.rng
        self.files = files
        self.stop_event = threading.Event()
        self.jumps = 0

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(0.2, 0.8)):
            who = self.rng.choice(list(self.files))
            write_atomic_text(self.files[who], str(self.rng.choice(OFFSETS)))
            self.jumps += 1


def clock_jumps(ctx: Ctx, res: Result) -> None:
    """Wall-clock jumps of ±30 s to ±1 day in node and daemon: lag metrics never negative, nothing crashes, exact."""
    res.duplicates_must_be_zero = True
    tmp = ctx.episode_dir("ep0")
    clocks = {"node": tmp / "node.clock", "daemon": tmp / "daemon.clock"}
    for path in clocks.values():
        path.write_text("0")
    ports = {"node": free_port(), "daemon": free_port()}
    phase_s = ctx.pick(2.5, 8.0)
    with rig(
        tmp,
        realtime_cdc=False,
        extra_path=[CLOCKPATCH],
        node_env={"CHAOS_CLOCK_FILE": str(clocks["node"]), "CHAOS_NODE_METRICS_PORT": str(ports["node"])},
        daemon_env={"CHAOS_CLOCK_FILE": str(clocks["daemon"])},
        daemon_settings={"metrics_address": f"127.0.0.1:{ports['daemon']}"},
    ) as r:
        r.start_node(pause_ms=20, every=ctx.pick(4, 10))  # ~8k / ~20k entries/s
        r.start_daemon()
        r.wait_mode("off", "ACTIVE")
        scraper, jumper = Scraper(ports), Jumper(ctx, clocks)
        scraper.start()
        jumper.start()
        status_lags: list[float] = []
        try:
            for phase in ("daemon", "node", "daemon"):
                if phase == "node":
                    r.switch_on()
                elif r.status()["realtime"]["mode"] != "off":
                    r.switch_off()
                deadline = time.monotonic() + phase_s
                while time.monotonic() < deadline:
                    st = r.status()
                    for key in ("lag_ms", "lag_segments"):
                        if st[key] is not None:
                            status_lags.append(float(st[key]))
                            check(st[key] >= 0, f"`cdcd control status` {key} = {st[key]} < 0")
                    for proc, who in ((r.node, "node"), (r.daemon, "daemon")):
                        check(proc is not None and proc.poll() is None, f"the {who} died during a clock jump")
                    time.sleep(0.2)
                res.runs += 1
        finally:
            jumper.stop_event.set()
            jumper.join()
            time.sleep(0.3)
            scraper.stop_event.set()
            scraper.join()
        r.stop_node()
        r.wait_daemon_caught_up()
        r.stop_daemon()
        d = r.delivery()
        res.add(d)
        d.check_clean("clock")
        check_exact(r)

        ts = [e["commit_ts_ns"] for e in wal_events(r.node_dir)]
        back = max((a - b for a, b in itertools.pairwise(ts)), default=0)
        fwd = max((b - a for a, b in itertools.pairwise(ts)), default=0)
        res.details.update(
            {
                "jumps": jumper.jumps,
                "scrapes": scraper.scrapes,
                "max_lag": {k: round(v, 3) for k, v in scraper.max_lag.items()},
                "wal_commit_ts_largest_backward_step_s": round(back / 1e9, 1),
                "wal_commit_ts_largest_forward_step_s": round(fwd / 1e9, 1),
                "daemon_last_commit_metric_largest_skew_s": round(scraper.last_commit_skew_s, 1),
                "status_lag_samples": len(status_lags),
            }
        )
        res.notes.append(
            f"{jumper.jumps} jumps; WAL commit_ts stepped back {back / 1e9:.0f}s / forward {fwd / 1e9:.0f}s; "
            f"{sum(scraper.scrapes.values())} scrapes, {len(scraper.negative)} negative lag samples"
        )
        check(not scraper.negative, f"negative lag metrics: {scraper.negative[:5]}")
        check(
            all(n >= 10 for n in scraper.scrapes.values()), f"too few scrapes: {scraper.scrapes} {scraper.errors[:2]}"
        )
        check(back > 10**9 and fwd > 10**9, "the node's clock did not jump (is the sitecustomize patch active?)")
        check(abs(scraper.last_commit_skew_s) > 10, "the daemon's clock did not jump (is the sitecustomize patch on?)")
        check("node:cdcd_node_realtime_lag_seconds_sum" in scraper.max_lag, "the node realtime lag metric was not seen")
        check("daemon:cdcd_daemon_lag_seconds" in scraper.max_lag, "the daemon's lag metric was not seen")
