"""Many caches into the Delta lake, and the files a live lake keeps per cache partition.

- ``lake.many_caches.<writer>``: a node writes 10,000 caches x 2 entries (one archived WAL, untimed);
  the timed part is a daemon landing all of it in ``<lake>/changes`` with the lake sink
  (``sync_once`` until nothing is left), for the Spark writer (``local[2]``) and the JVM-free one.
  Checks the table holds every row. Goal: < 30 s (issue 19.7).
- ``lake.files.live``: a node (a subprocess) writes 5k entries/s over 4 caches (keys cycling
  through 1M) for 10 minutes (``--quick``: 2 minutes; ``BENCH_LIVE_S`` and ``BENCH_LIVE_RATE`` set
  another length and rate, such as the hour issue 31 asks for), archiving a segment every second;
  an in-process daemon lands it with the JVM-free writer and the lake sink's default maintenance
  (scheduled compaction and optimize at ``LakeOptions``' default intervals). At the end: the active
  files per cache partition of ``changes`` and of ``state`` (from the Delta snapshots), max and
  mean, the typed tables' files, and how long a Spark reader's first ``count(*) GROUP BY cache`` of
  ``state`` takes in a running session. Goals: <= 20 files (issues 15 and 31), the read < 2 s
  (issue 31).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tests.support.bench import Bench, Measurement, Metric

MANY_CACHES = 10_000
MANY_CACHES_GOAL_S = 30.0
MASTER = "local[2]"


def _bench_dir() -> str:
    var = Path(__file__).resolve().parents[2] / "var"
    var.mkdir(exist_ok=True)
    return str(var)


def write_many_caches(node_dir: Path, caches: int) -> int:
    """``caches`` caches x 2 entries, one archived WAL; the number of entries."""
    from cdcd.node import Node

    with Node.open(str(node_dir), wal_force_archive_timeout_ms=0, wal_mode="background") as node:
        for i in range(caches):
            cache = node.cache(f"cache-{i}")
            cache.put(1, {"a": i})
            cache.put(2, {"b": i})
        node.force_archive()
    return 2 * caches


def changes_rows(lake: Path) -> int:
    import pyarrow as pa
    from deltalake import DeltaTable

    adds = pa.table(DeltaTable(str(lake / "changes")).get_add_actions(flatten=True))
    return int(sum(adds.column("num_records").to_pylist()))


def files_per_partition(table: Path) -> dict[str, int]:
    """Active files per cache partition of a Delta table, from its snapshot."""
    import pyarrow as pa
    from deltalake import DeltaTable

    adds = pa.table(DeltaTable(str(table)).get_add_actions(flatten=True))
    counts: dict[str, int] = {}
    for cache in adds.column("partition.cache").to_pylist():
        counts[cache] = counts.get(cache, 0) + 1
    return counts


class ManyCaches:
    """One WAL of 10,000 caches x 2 entries written in setup; each run lands a copy into a new lake."""

    def __init__(self, caches: int) -> None:
        self.caches = caches
        self.root: Path | None = None
        self.entries = 0

    def setup(self) -> None:
        if self.root is not None:
            return
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-caches-", dir=_bench_dir()))
        self.entries = write_many_caches(self.root / "base", self.caches)

    def run(self, writer: str) -> Measurement:
        from cdcd.daemon import Daemon, DaemonConfig
        from cdcd.lake.sink import LakeConsumer, LakeOptions

        assert self.root is not None
        work = self.root / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(self.root / "base", work / "node")
        lake = work / "lake"
        opts = LakeOptions(
            lake_path=str(lake),
            writer=writer,  # type: ignore[arg-type]
            spark_master=MASTER,
            compact_interval_s=0,  # landing is timed, not maintenance
            optimize_interval_s=0,
        )
        sink = LakeConsumer(opts)
        if writer == "spark":
            from cdcd.lake import spark as spark_session

            spark_session.acquire(MASTER, "cdcd-lake", {})  # warm: the JVM's start is not landing
        try:
            t0 = time.perf_counter()
            with Daemon(DaemonConfig(node_dir=str(work / "node"), metrics_address=""), sink) as daemon:
                while daemon.sync_once() > 0:
                    pass
            seconds = time.perf_counter() - t0
        finally:
            if writer == "spark":
                from cdcd.lake import spark as spark_session

                spark_session.release()
        rows = changes_rows(lake)
        if rows != self.entries or sink.rows_written != self.entries:
            raise AssertionError(f"landed {rows:,} rows ({sink.rows_written:,} written), expected {self.entries:,}")
        files = len(files_per_partition(lake / "changes"))
        return Measurement(self.entries, seconds, {"cache_partitions": files}, value=seconds)

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


LIVE_RATE = int(os.environ.get("BENCH_LIVE_RATE") or 5_000)
LIVE_CACHES = 4
LIVE_KEYS = 1_000_000
READ_GOAL_S = 2.0
LIVE_FULL_S = 600.0
LIVE_QUICK_S = 120.0
FILES_GOAL = 20
SAMPLE_EVERY_S = 30.0
"""How often ``lake.files.live`` counts the files of ``changes`` during the run."""


def live_writer(node_dir: str, seconds: float, rate: int, caches: int) -> None:
    """The node of ``lake.files.live`` (a process of its own): ``rate`` entries/s over ``caches``
    caches for ``seconds`` (keys cycling through ``LIVE_KEYS``: creates first, then updates), archiving
    a segment every second (the live archive mode)."""
    from cdcd.node import Node

    with Node.open(node_dir, wal_force_archive_timeout_ms=1000, wal_mode="background") as node:
        handles = [node.cache(f"live-{i}") for i in range(caches)]
        written = 0
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            due = int(now * rate)
            while written < due:
                handles[written % caches].put(written % LIVE_KEYS, {"i": written, "pad": "x" * 64})
                written += 1
            time.sleep(0.01)
        node.force_archive()
    (Path(node_dir) / "written").write_text(str(written))


def _first_read_s(spark: object, state: Path) -> float:
    """A reader's first query of ``state`` in a running Spark session: snapshot load, file listing
    and the scan; what a data engineer waits for."""
    t0 = time.perf_counter()
    spark.read.format("delta").load(str(state)).groupBy("cache").count().collect()  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def run_live(duration_s: float) -> Measurement:
    """``live_writer`` in a subprocess; an in-process daemon lands what it archives with the lake sink
    (JVM-free writer) and its default maintenance."""
    import subprocess
    import sys

    from deltalake import DeltaTable

    from cdcd.daemon import Daemon, DaemonConfig
    from cdcd.lake import spark as spark_session
    from cdcd.lake.sink import LakeConsumer, LakeOptions
    from cdcd.lake.typed.layout import list_tables
    from tests.support.bench import _child_env
    from tests.support.procs import reap

    root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-live-", dir=_bench_dir()))
    proc: subprocess.Popen[bytes] | None = None
    try:
        node_dir, lake = root / "node", root / "lake"
        opts = LakeOptions(lake_path=str(lake), writer="deltalake", spark_master=MASTER)
        sink = LakeConsumer(opts)
        args = [str(node_dir), str(duration_s), str(LIVE_RATE), str(LIVE_CACHES)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.bench_lake_caches", "live-writer", *args], env=_child_env()
        )
        deadline = time.monotonic() + 60
        while not (node_dir / "cdc").is_dir():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"the live writer did not start (exit {proc.poll()})")
            time.sleep(0.1)
        # The count at the end is one point of the maintenance cycle: it is sampled through the run too.
        sampled: list[tuple[float, int]] = []
        next_sample = time.monotonic() + SAMPLE_EVERY_S
        late_from = time.monotonic() + duration_s * 0.75
        with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), sink) as daemon:
            while proc.poll() is None:
                if daemon.sync_once() == 0:
                    time.sleep(0.1)
                if time.monotonic() >= next_sample and (lake / "changes" / "_delta_log").is_dir():
                    next_sample += SAMPLE_EVERY_S
                    sampled.append((time.monotonic(), max(files_per_partition(lake / "changes").values())))
            if proc.returncode != 0:
                raise AssertionError(f"the live writer exited {proc.returncode}")
            while daemon.sync_once() > 0:
                pass
            if not (lake / "state").is_dir():
                raise AssertionError(f"no scheduled compaction finished in {duration_s:.0f} s")
            counts = files_per_partition(lake / "changes")
            state_counts = files_per_partition(lake / "state")
            table_files = {c: len(DeltaTable(str(p)).file_uris()) for c, p in list_tables(lake).items()}
            maintainer = sink._maintainer
            runs = (maintainer.compactions, maintainer.optimizations) if maintainer else (0, 0)
        written = int((node_dir / "written").read_text())
        if changes_rows(lake) != written:
            raise AssertionError(f"lake holds {changes_rows(lake):,} rows of {written:,}")
        spark = spark_session.acquire(MASTER, "cdcd-bench-reader", {})
        try:
            read_s = _first_read_s(spark, lake / "state")
        finally:
            spark_session.release()
        worst = max(max(counts.values()), max(state_counts.values(), default=0))
        late = [n for t, n in sampled if t >= late_from]  # the last quarter: well past the first OPTIMIZE runs
        extra = {
            "mean_files": round(sum(counts.values()) / len(counts), 1),
            "state_max_files": max(state_counts.values(), default=0),
            "table_max_files": max(table_files.values(), default=0),
            "state_read_s": round(read_s, 2),
            "late_max_files": max(late, default=None),
            "late_median_files": statistics.median(late) if late else None,
            "samples": len(sampled),
            "compact_interval_s": opts.compact_interval_s,
            "optimize_interval_s": opts.optimize_interval_s,
            "compactions": runs[0],
            "optimizations": runs[1],
        }
        return Measurement(written, duration_s, extra, value=worst)
    finally:
        reap(proc)
        if not os.environ.get("BENCH_KEEP_LAKE"):  # set: the lake stays for a look afterwards
            shutil.rmtree(root, ignore_errors=True)


def benchmarks(quick: bool) -> list[Bench]:
    caches = ManyCaches(1000 if quick else MANY_CACHES)
    live_s = float(os.environ.get("BENCH_LIVE_S") or (LIVE_QUICK_S if quick else LIVE_FULL_S))
    out = [
        Bench(
            name=f"lake.many_caches.{writer}",
            description=f"{caches.caches:,} caches x 2 entries landed by the {writer} writer",
            run_once=lambda writer=writer: caches.run(writer),  # type: ignore[misc]
            metric="land",
            unit="s",
            goal=MANY_CACHES_GOAL_S,
            lower_is_better=True,
            setup=caches.setup,
            teardown=caches.cleanup if writer == "deltalake" else None,
            max_repeats=1 if quick else 2,
            params={"caches": caches.caches, "entries_per_cache": 2, "writer": writer, "spark_master": MASTER},
        )
        for writer in ("spark", "deltalake")
    ]
    out.append(
        Bench(
            name="lake.files.live",
            description=f"files per cache partition of changes and state after {live_s:.0f} s live at {LIVE_RATE:,}/s",
            run_once=lambda: run_live(live_s),
            metric="max_files",
            unit="files",
            goal=FILES_GOAL,
            lower_is_better=True,
            max_repeats=1,
            more=(
                Metric("mean_files", "mean_files", "files", FILES_GOAL, lower_is_better=True),
                Metric("state_max_files", "state_max_files", "files", FILES_GOAL, lower_is_better=True),
                Metric("table_max_files", "table_max_files", "files", lower_is_better=True),
                Metric("state_read", "state_read_s", "s", READ_GOAL_S, lower_is_better=True),
                Metric("late_max_files", "late_max_files", "files", lower_is_better=True),
                Metric("late_median_files", "late_median_files", "files", lower_is_better=True),
            ),
            params={
                "rate": LIVE_RATE,
                "caches": LIVE_CACHES,
                "keys": LIVE_KEYS,
                "seconds": live_s,
                "writer": "deltalake",
            },
        )
    )
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["live-writer"]:
        from cdcd.logging import configure

        configure("console", "warning")
        live_writer(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit("usage: python -m tests.bench.bench_lake_caches live-writer NODE_DIR SECONDS RATE CACHES")
