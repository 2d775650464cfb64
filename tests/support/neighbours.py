"""Daemons that keep one lake side by side (issue 29 item 4), shared by tests/test_lake_neighbours.py and the
`lake-neighbours` chaos scenario: ``daemons`` nodes under load, one `cdcd run` each, all landing into ONE local
lake and each running scheduled compaction and OPTIMIZE on it, for ``run_s`` seconds; then the writers stop, every
daemon catches up, a scheduled compaction folds the last changes into `state`, every daemon stops (exit 0), the
lake's `changes` holds each node's WAL exactly once, entry by entry, and `cdcd lake verify` with every node dir
says OK. Each node writes keys of its own (``key_base``), as a cluster's nodes each own theirs: two independent
nodes writing the SAME keys leave a lake whose `state` (per key the highest version of either) no node's data can
be checked against, which verify names (`lake_verify_conflicting_nodes`) rather than counts.

A daemon's maintenance makes progress by its own runs or by a neighbour's run it recognises as such
(`lake_maintenance_by_neighbour`: a compaction that lost to one folding the same changes, an OPTIMIZE due just
after a neighbour's). All along, the lake's compaction lag is sampled: how long after a `changes` version appears
`state` reflects it (``NeighboursRun.max_lag_s``). ``until_collision``: the run ends, instead of after ``run_s``,
once the daemons' maintenance collided (a run lost to a neighbour's commit) and each has compacted."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.maintenance.compact import compacted_version, state_lag, table_version
from cdcd.node.identity import read_node_id
from tests.support.delta_lake import QUICK_START, lake_consumer
from tests.support.lake import caught_up, position, write_config
from tests.support.procs import cdcd, log_events, start_daemon, stop_daemon, wait_for, wait_progress
from tests.support.wal import wal_events
from tests.support.writer import KEYSPACE, start_writer


@dataclass
class NeighboursRun:
    runs: list[tuple[int, int]]
    """(compactions, optimizations) per daemon: its own runs."""
    by_neighbour: list[tuple[int, int]]
    """(compactions, optimizations) per daemon that a neighbour had done (recognised, logged, counted)."""
    conflicts: int
    """Maintenance runs that lost to a neighbour's commit (retried)."""
    failures: int
    """Maintenance runs that failed for real (logged, counted toward maintenance_max_failures)."""
    entries: int
    """WAL data entries of all nodes, each landed once."""
    max_lag_s: float
    """Longest time, over the samples, from a `changes` version being seen to `state` reflecting it."""
    lag_samples: int
    lag_errors: list[str]
    """Samples that failed (a read racing the daemons' commits)."""

    @property
    def progress(self) -> list[tuple[int, int]]:
        """(compactions, optimizations) per daemon, its own and its neighbours' recognised ones."""
        return [(c + nc, o + no) for (c, o), (nc, no) in zip(self.runs, self.by_neighbour, strict=True)]


class LagSampler:
    """Samples (time, changes version, version `state` reflects) every ``every_s`` on a thread of its own."""

    def __init__(self, lake: Path, every_s: float = 2.0) -> None:
        self.lake = lake
        self.every_s = every_s
        self.samples: list[tuple[float, int, int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lag-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                end = table_version(self.lake / "changes")
                if end is not None:
                    self.samples.append((time.monotonic(), end, compacted_version(self.lake)))
            except Exception as exc:  # a read racing the daemons' commits: kept, reported with the result
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    def max_lag_s(self) -> float:
        """Per sample, the time until a later sample's `state` reflects its changes version (still open at
        the end: until the last sample); the longest of them."""
        worst = 0.0
        for i, (t, end, _) in enumerate(self.samples):
            later = (u for u, _, done in self.samples[i:] if done >= end)
            worst = max(worst, next(later, self.samples[-1][0]) - t)
        return worst


def run_neighbours(
    tmp: Path,
    run_s: float,
    *,
    daemons: int = 2,
    pause_ms: int = 400,
    until_collision: bool = False,
    compact_interval_s: float = 2.0,
    optimize_interval_s: float = 3.0,
) -> NeighboursRun:
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
        compact_interval_s=compact_interval_s,
        optimize_interval_s=optimize_interval_s,
        typed_tables=False,  # state only: the runs collide sooner, and two JVMs share two cores
    )
    configs = [write_config(tmp / f"cdcd{i}.toml", d, consumer, batch_max_events=5000) for i, d in enumerate(dirs)]
    errs = [tmp / f"daemon{i}.err" for i in range(daemons)]
    procs = [start_daemon(c, e) for c, e in zip(configs, errs, strict=True)]

    def exited() -> str:
        gone = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        return "; ".join(f"daemon {i} exited {rc}: {errs[i].read_text()[-1500:]}" for i, rc in gone)

    def done(err: Path) -> tuple[int, int]:
        """(compactions, optimizations) of a daemon, its own and those a neighbour had done."""
        c = Counter((e["event"], e.get("task")) for e in log_events(err))
        compactions = c["lake_maintenance_compacted", None] + c["lake_maintenance_by_neighbour", "compact"]
        return compactions, c["lake_maintenance_optimized", None] + c["lake_maintenance_by_neighbour", "optimize"]

    def collided() -> bool:
        """A real conflict: a run retried, or a compaction that lost to a neighbour's of the same changes."""
        events = {(e["event"], e.get("task")) for err in errs for e in log_events(err)}
        return any(
            e == "lake_maintenance_conflict" or (e, t) == ("lake_maintenance_by_neighbour", "compact")
            for e, t in events
        )

    sampler = LagSampler(lake)
    try:
        sampler.start()
        wait_for(
            lambda: exited() or all(done(e)[0] for e in errs), 600, "a compaction (own or a neighbour's) in each", 0.5
        )
        assert not exited(), exited()
        t0 = time.monotonic()

        def maintained(err: Path) -> bool:
            """A compaction and one more run (compaction or OPTIMIZE): maintenance beside a neighbour."""
            compactions, optimizations = done(err)
            return compactions >= 1 and compactions + optimizations >= 2

        def finished() -> bool:
            if until_collision:
                return collided()
            return time.monotonic() - t0 >= run_s and all(map(maintained, errs))

        # The run lasts run_s (or until a collision) and until each daemon's maintenance ran twice (a
        # loaded machine is slower at it); the daemons are watched all along (none may exit).
        wait_for(lambda: exited() or finished(), run_s + 900, "the run, with two maintenance runs in each", 0.5)
        assert not exited(), exited()
        sampler.stop()  # the lag under load: once writers stop, OPTIMIZE alone moves the changes version
        for i in range(daemons):
            (tmp / f"w{i}" / "writer.stop").touch()
        for w in writers:
            assert w.wait(120) == 0
        for i, d in enumerate(dirs):
            until = caught_up(d)

            def where(i: int = i) -> object:
                return "exited" if exited() else position(configs[i])

            # A catch-up on a machine busy with other work takes as long as it takes (a run at load 30 landed
            # 100 segments in 5 minutes); one whose position stands still for 300 s is a failure.
            wait_progress(
                where, lambda pos, until=until: pos in ("exited", until), 300, f"daemon {i} to land {until}", 0.5
            )
            assert not exited(), exited()
        # The daemons' own scheduled compaction folds the last changes in (no extra Spark session for it).
        wait_for(lambda: bool(exited()) or not state_lag(lake)[2], 600, "a compaction of the last changes", 0.5)
        assert not exited(), exited()
    finally:
        sampler.stop()
        for w in writers:
            if w.poll() is None:
                w.kill()
        rcs = [stop_daemon(p, timeout=120) if p.poll() is None else p.returncode for p in procs]
    assert rcs == [0] * daemons, [e.read_text()[-2000:] for e in errs]

    counts = [Counter((e["event"], e.get("task")) for e in log_events(err)) for err in errs]
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
    assert sampler.samples, f"no lag sample: {sampler.errors[:3]}"
    return NeighboursRun(
        runs=[(c["lake_maintenance_compacted", None], c["lake_maintenance_optimized", None]) for c in counts],
        by_neighbour=[
            (c["lake_maintenance_by_neighbour", "compact"], c["lake_maintenance_by_neighbour", "optimize"])
            for c in counts
        ],
        conflicts=sum(n for c in counts for (event, _), n in c.items() if event == "lake_maintenance_conflict"),
        failures=sum(n for c in counts for (event, _), n in c.items() if event == "lake_maintenance_failed"),
        entries=sum(want.values()),
        max_lag_s=sampler.max_lag_s(),
        lag_samples=len(sampler.samples),
        lag_errors=sampler.errors,
    )
