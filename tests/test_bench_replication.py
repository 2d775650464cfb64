"""Smoke test of the replication benchmarks (``tests.bench.bench_replication``) in their ``--quick`` form."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.bench import bench_replication
from tests.support.bench import run_bench

NAMES = ["replication.catchup", "replication.live", "replication.live.realtime"]


def _children() -> list[str]:
    """Command lines of this process's live (not zombie) child processes."""
    out = []
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[1] == me and fields[0] != "Z":
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue  # exited meanwhile
    return out


def test_quick_replication_benchmarks_report_positive_rows() -> None:
    """One repetition of each quick benchmark: every row holds one positive value, B held every key,
    and no node process or temp dir is left behind."""
    # Children other tests in this process left running (the worker's Spark JVM) are not ours.
    before = set(_children())
    started = time.monotonic()
    benches = bench_replication.benchmarks(quick=True)
    assert [b.name for b in benches] == NAMES
    logged: list[str] = []
    results = [r for b in benches for r in run_bench(b, 1, logged.append)]
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"quick form took {elapsed:.0f}s"

    assert [r.name for r in results] == [b.name for b in benches for _ in range(1 + len(b.more))]
    for r in results:
        assert r.error is None, (r.name, r.metric, r.error, logged[-3:])
        assert len(r.values) == 1 and r.values[0] > 0, (r.name, r.metric, r.values)

    catchup = results[0].measurements[0]
    assert catchup.count == catchup.extra["target_keys"] == 50_000
    assert catchup.extra["apply_requests"] > 0 and catchup.extra["receiver_cpu_us_per_entry"] > 0
    for r in results:
        if r.name.startswith("replication.live") and r.metric == "p50":
            run = r.measurements[0].extra
            assert run["p50_ms"] <= run["p99_ms"] <= run["max_ms"], run
            # Entries written and measured; the rate the writer reached is the benchmark's figure to report, not this
            # test's (a machine busy with other work writes fewer in the same 3 s).
            assert run["written"] > 0 and run["write_rate"] > 0, run
    assert bench_replication.BACKLOG.root is None  # teardown removed node A's backlog
    assert [c for c in _children() if c not in before] == []
