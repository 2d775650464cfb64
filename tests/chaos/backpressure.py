"""Scenario 6: a slow consumer (``chaos_sinks:SlowJsonl``, 100 ms of sleep per batch) in front of a large backlog.

The daemon's reader could read the whole backlog in a second or two; only the bounded queues between reader, decoder
and consumer (back-pressure) keep it from holding it in memory. ``VmRSS`` of the ``cdcd run`` process is sampled every
50 ms from /proc: after a warm-up (10% of the backlog delivered) it may grow by less than ``MAX_GROWTH_MB`` while the
consumer works through the rest. Delivery must be exact (no process dies: no duplicates).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.support.chaos import PLUGINS, Ctx, Result, check, jsonl_delivery, rss_kb, track
from tests.support.config import write_daemon_config
from tests.support.procs import child_env, polled_position, start_daemon, stop_daemon, wait_for
from tests.support.wal import archived_segments, read_jsonl, wal_events
from tests.support.writer import make_node

MAX_GROWTH_MB = 30
DELAY_MS = 100
SETTINGS = {
    "batch_max_events": 5000,
    "batch_max_delay_ms": 100,
    "queue_max_batches": 2,
    "read_chunk_records": 1024,
    "check_interval_ms": 200,
}


class Sampler(threading.Thread):
    """(seconds since start, VmRSS KiB, lines delivered) every 50 ms until the process is gone or stopped."""

    def __init__(self, pid: int, out: Path) -> None:
        super().__init__(name="chaos-rss", daemon=True)
        self.pid = pid
        self.out = out
        self.samples: list[tuple[float, int, int]] = []
        self.stop_event = threading.Event()
        self.line_bytes = 0.0

    def delivered(self) -> int:
        """Lines in the output, estimated from its size once the average line length is known."""
        try:
            size = self.out.stat().st_size
        except FileNotFoundError:
            return 0
        if not self.line_bytes and size > 200_000:
            with self.out.open("rb") as f:
                head = f.read(200_000)
            self.line_bytes = len(head) / max(1, head.count(b"\n"))
        return int(size / self.line_bytes) if self.line_bytes else 0

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop_event.wait(0.05):
            rss = rss_kb(self.pid)
            if rss is None:
                return
            self.samples.append((time.monotonic() - t0, rss, self.delivered()))


def slow_consumer(ctx: Ctx, res: Result) -> None:
    """A consumer sleeping 100 ms per batch in front of a large backlog: the daemon's RSS stays flat, delivery exact."""
    res.duplicates_must_be_zero = True
    tmp = ctx.episode_dir("ep0")
    node_dir = tmp / "node"
    out = tmp / "events.jsonl"
    make_node(node_dir, segments=ctx.pick(10, 40), tx_per_segment=500, wal_segment_size_bytes=2 << 20)
    expected = wal_events(node_dir)
    wal_mb = sum(p.stat().st_size for p in archived_segments(node_dir).values()) / 2**20
    consumer = {"kind": "python", "class": "chaos_sinks:SlowJsonl", "options": {"path": str(out), "delay_ms": DELAY_MS}}
    config = write_daemon_config(tmp / "cdcd.toml", node_dir, consumer, **SETTINGS)
    err = tmp / "daemon.err"
    proc = track(start_daemon(config, err, env=child_env(PLUGINS)))
    sampler = Sampler(proc.pid, out)
    sampler.start()
    until = (max(archived_segments(node_dir)) + 1, 0, 0)
    t0 = time.monotonic()
    try:
        wait_for(
            lambda: proc.poll() is not None or polled_position(config) == until,
            600,
            f"the slow consumer to commit {until}",
            interval=0.5,
        )
        check(proc.poll() is None, f"the daemon died: {err.read_text()[-1500:]}")
    finally:
        sampler.stop_event.set()
        sampler.join()
        rc = stop_daemon(proc)
    elapsed = time.monotonic() - t0
    check(rc == 0, f"daemon exit {rc}: {err.read_text()[-1500:]}")
    res.runs += 1
    d = jsonl_delivery(expected, [read_jsonl(out)])
    res.add(d)
    d.check_clean("slow consumer")

    samples = sampler.samples
    check(len(samples) > 20, f"only {len(samples)} RSS samples")
    warm_at = next((i for i, s in enumerate(samples) if s[2] >= 0.1 * len(expected)), None)
    check(warm_at is not None, "never reached the warm-up point (10% delivered)")
    assert warm_at is not None
    warm = samples[warm_at][1]
    after = samples[warm_at:]
    peak = max(s[1] for s in after)
    peak_at = next(s for s in after if s[1] == peak)
    first = samples[0][1]
    growth_mb = (peak - warm) / 1024
    rate = len(expected) / elapsed
    res.details.update(
        {
            "backlog_entries": len(expected),
            "backlog_wal_mb": round(wal_mb, 1),
            "seconds": round(elapsed, 1),
            "entries_per_s": round(rate),
            "rss_first_mb": round(first / 1024, 1),
            "rss_warm_mb": round(warm / 1024, 1),
            "rss_peak_mb": round(peak / 1024, 1),
            "rss_peak_at_delivered": peak_at[2],
            "rss_last_mb": round(samples[-1][1] / 1024, 1),
            "growth_after_warmup_mb": round(growth_mb, 1),
            "samples": len(samples),
        }
    )
    res.notes.append(
        f"backlog {len(expected)} entries ({wal_mb:.0f} MB of WAL) in {elapsed:.0f}s; "
        f"VmRSS first {first / 1024:.0f} MB, at warm-up {warm / 1024:.0f} MB, "
        f"peak {peak / 1024:.0f} MB (+{growth_mb:.1f} MB), last {samples[-1][1] / 1024:.0f} MB"
    )
    check(elapsed > 3, f"the backlog took only {elapsed:.1f}s: the consumer was not the bottleneck")
    check(growth_mb < MAX_GROWTH_MB, f"RSS grew by {growth_mb:.1f} MB after warm-up (limit {MAX_GROWTH_MB} MB)")
