"""Daemons that keep one lake side by side (issue 29 item 4), shared by tests/test_lake_neighbours.py and the
`lake-neighbours` chaos scenario: ``daemons`` nodes under load, one `cdcd run` each, all landing into ONE local
lake and each running scheduled compaction and OPTIMIZE on it, for ``run_s`` seconds; then the writers stop, every
daemon catches up, a scheduled compaction folds the last changes into `state`, every daemon stops (exit 0), the
lake's `changes` holds each node's WAL exactly once, entry by entry, and `cdcd lake verify` with every node dir
says OK. Each node writes keys of its own (``key_base``), as a cluster's nodes each own theirs: two independent
nodes writing the SAME keys leave a lake whose `state` (per key the highest version of either) no node's data can
be checked against, which verify names (`lake_verify_conflicting_nodes`) rather than counts."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.compact import state_lag
from cdcd.node.identity import read_node_id
from tests.support.delta_lake import QUICK_START, lake_consumer
from tests.support.lake import caught_up, position, write_config
from tests.support.procs import cdcd, log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import KEYSPACE, start_writer


@dataclass
class NeighboursRun:
    runs: list[tuple[int, int]]
    """(compactions, optimizations) per daemon."""
    conflicts: int
    """Maintenance runs that lost to a neighbour's commit (retried)."""
    failures: int
    """Maintenance runs that failed for real (logged, counted toward maintenance_max_failures)."""
    entries: int
    """WAL data entries of all nodes, each landed once."""


def run_neighbours(tmp: Path, run_s: float, *, daemons: int = 2, pause_ms: int = 400) -> NeighboursRun:
    lake = tmp / "lake"
    dirs = [tmp / f"n{i}" for i in range(daemons)]
    writers = []
    for i, d in enumerate(dirs):
        (tmp / f"w{i}").mkdir()
        writers.append(start_writer(tmp / f"w{i}", d, count=0, pause_ms=pause_ms, key_base=i * KEYSPACE))
    wait_for(lambda: all((d / "cdc").is_dir() for d in dirs), 120, "the nodes' cdc dirs")
    consumer = lake_consumer(
        lake,
        spark_master="local[1]",
        spark_conf=QUICK_START,
        compact_interval_s=2,
        optimize_interval_s=3,
        typed_tables=False,  # state only: the runs collide sooner, and two JVMs share two cores
    )
    configs = [write_config(tmp / f"cdcd{i}.toml", d, consumer, batch_max_events=5000) for i, d in enumerate(dirs)]
    errs = [tmp / f"daemon{i}.err" for i in range(daemons)]
    procs = [start_daemon(c, e) for c, e in zip(configs, errs, strict=True)]

    def exited() -> str:
        gone = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        return "; ".join(f"daemon {i} exited {rc}: {errs[i].read_text()[-1500:]}" for i, rc in gone)

    def compacted(err: Path) -> bool:
        return any(e["event"] == "lake_maintenance_compacted" for e in log_events(err))

    try:
        wait_for(lambda: exited() or all(map(compacted, errs)), 600, "a scheduled compaction in each daemon", 0.5)
        assert not exited(), exited()
        t0 = time.monotonic()

        def maintained(err: Path) -> bool:
            """A compaction and one more run (compaction or OPTIMIZE): maintenance beside a neighbour."""
            c = Counter(e["event"] for e in log_events(err))
            done = c["lake_maintenance_compacted"], c["lake_maintenance_optimized"]
            return done[0] >= 1 and sum(done) >= 2

        # The run lasts run_s and until each daemon's maintenance ran twice (a loaded machine is slower at it);
        # the daemons are watched all along (none may exit).
        wait_for(
            lambda: exited() or (time.monotonic() - t0 >= run_s and all(map(maintained, errs))),
            run_s + 900,
            "the run under load, with two maintenance runs in each daemon",
            0.5,
        )
        assert not exited(), exited()
        for i in range(daemons):
            (tmp / f"w{i}" / "writer.stop").touch()
        for w in writers:
            assert w.wait(120) == 0
        for i, d in enumerate(dirs):
            until = caught_up(d)

            def landed(i: int = i, until: tuple[int, int, int] = until) -> bool:
                return bool(exited()) or position(configs[i]) == until

            wait_for(landed, 300, f"daemon {i} to land {until}", 0.25)
            assert not exited(), exited()
        # The daemons' own scheduled compaction folds the last changes in (no extra Spark session for a final one).
        wait_for(lambda: bool(exited()) or not state_lag(lake)[2], 600, "a compaction of the last changes", 0.5)
        assert not exited(), exited()
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
        rcs = [stop_daemon(p, timeout=120) if p.poll() is None else p.returncode for p in procs]
    assert rcs == [0] * daemons, [e.read_text()[-2000:] for e in errs]

    counts = [Counter(e["event"] for e in log_events(err)) for err in errs]
    for err in errs:
        for e in log_events(err):
            if e["event"] == "lake_maintenance_conflict":
                assert e["level"] == "warning" and e["task"] in ("compact", "optimize") and "\n" not in e["error"]

    rows = DeltaTable(str(lake / "changes")).to_pyarrow_table(
        columns=["source_node", "wal_segment", "wal_offset", "wal_index"]
    )
    columns = ("source_node", "wal_segment", "wal_offset", "wal_index")
    got = Counter(zip(*(rows.column(c).to_pylist() for c in columns), strict=True))
    want: Counter[tuple[str, int, int, int]] = Counter()
    for d in dirs:
        node = str(read_node_id(d))
        want.update((node, *e["pos"]) for e in wal_events(d))
    assert max(got.values()) == 1, "an entry landed twice"
    assert got == want, f"{len(set(want) - set(got))} missing, {len(set(got) - set(want))} unknown"
    res = cdcd("lake", "verify", "--lake", str(lake), *[a for d in dirs for a in ("--node-dir", str(d))], timeout=600)
    assert res.returncode == 0 and res.stdout.rstrip().endswith(", OK"), res.stdout + res.stderr[-3000:]
    return NeighboursRun(
        runs=[(c["lake_maintenance_compacted"], c["lake_maintenance_optimized"]) for c in counts],
        conflicts=sum(c["lake_maintenance_conflict"] for c in counts),
        failures=sum(c["lake_maintenance_failed"] for c in counts),
        entries=sum(want.values()),
    )
