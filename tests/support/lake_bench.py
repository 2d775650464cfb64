"""The lake benchmarks' shared SparkSession (``tests/bench/bench_lake.py`` and the lake row of
``tests/bench/bench_pg.py``): one reference held across benchmarks, its cold start-up and a
warm-up landing kept out of every timing, and the JVM's CPU time."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from cdcd.daemon.config import DaemonConfig
from tests.support.cpu import cpu_s, stat_fields

SPARK_MASTER = "local[2]"
APP_NAME = "cdcd-bench-lake"
WARMUP_ROWS = 10_000

INGEST_BATCH_EVENTS = 500_000
"""The best of a sweep over a 1M backlog with sync_once (2 rounds, a busy 2-CPU host): 100k 37k,
200k 36-40k, 300k 28-45k, 500k 42-75k rows/s. From 250k rows on the sink writes two files
(``max_files_per_batch=2``), so both local cores write; fewer batches also mean fewer Spark jobs."""
INGEST_BATCH_BYTES = 1 << 30
"""Never the limit (500k entries are ~70 MB of records)."""
INGEST_BATCH_DELAY_MS = 1000
"""``run()`` only: the decoder closes a batch once it is this old whenever the reader is slower than
that for a moment (GIL contention with the sink), even mid-backlog: with the default 100 ms a 1M
backlog landed in ~20 batches of ~50k instead of 2-3 (16-28k vs 28-38k rows/s, JVM CPU 19-26 vs
7-10 us/row). A backlog's last, partial batch does not wait for it (a caught-up reader closes it)."""


def ingest_config(
    node_dir: Path, *, batch_events: int = INGEST_BATCH_EVENTS, batch_delay_ms: int = INGEST_BATCH_DELAY_MS
) -> DaemonConfig:
    """The daemon configuration of the lake ingest benchmarks (``lake.ingest*`` and ``catchup.lake``):
    no metrics endpoint, the ingest batch settings."""
    return DaemonConfig(
        node_dir=str(node_dir),
        metrics_address="",
        batch_max_events=batch_events,
        batch_max_bytes=INGEST_BATCH_BYTES,
        batch_max_delay_ms=batch_delay_ms,
        consumer={"kind": "lake"},
    )


def bench_dir() -> str | None:
    return os.environ.get("CDCD_BENCH_DIR") or None


class SharedSpark:
    """One reference to the process's SparkSession held across benchmarks, so a sink's start()/stop()
    per repetition never starts or stops Spark; released at exit."""

    def __init__(self) -> None:
        self.session: Any = None
        self.startup_s: float | None = None
        self.warmup_s: float | None = None
        self._jvm_pid: int | None = None

    def ensure(self) -> Any:
        if self.session is None:
            from cdcd.lake import spark as spark_session

            t0 = time.perf_counter()
            self.session = spark_session.acquire(SPARK_MASTER, APP_NAME, {})
            self.session.range(1).count()  # the first job, so the number is "ready to work"
            self.startup_s = round(time.perf_counter() - t0, 2)
            atexit.register(self.release)
            t0 = time.perf_counter()
            self._warm_up()
            self.warmup_s = round(time.perf_counter() - t0, 2)
        return self.session

    def _warm_up(self, rows: int = WARMUP_ROWS) -> None:
        """A small landing through the Spark writer's tasks (Python workers started, cdcd imported
        there) and a small compaction-like window query: class loading, worker start-up and code
        generation happen here, not in a timing."""
        import msgspec
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        from cdcd.consumer import RecordSlice
        from cdcd.lake.landing.delta import ChangeTable
        from cdcd.lake.landing.spark_write import BatchInfo, write_on_executors
        from cdcd.lake.storage import LakeLocation
        from cdcd.wal.pointer import WalPointer
        from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, Op

        def key(k: int) -> msgspec.Raw:
            return msgspec.Raw(msgspec.msgpack.encode(k))

        value = msgspec.Raw(msgspec.msgpack.encode(lake_value(0)))
        records = [
            RecordSlice(
                WalPointer(0, 100 * r),
                DataRecord(
                    tuple(
                        DataEntry(1, Op.CREATE, key(k), value, 0, CacheVersion(k, 1, 0, 1))
                        for k in range(r * 10, r * 10 + 10)
                    ),
                    1_700_000_000 * 10**9,
                ),
            )
            for r in range(rows // 10)
        ]
        tmp = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-warmup-", dir=bench_dir()))
        try:
            changes = ChangeTable(tmp / "a", False)
            changes.open()
            half = len(records) // 2
            for _ in range(2):  # both local cores' Python workers
                write_on_executors(
                    self.session,
                    changes,
                    LakeLocation(str(tmp / "a")),
                    [records[:half], records[half:]],
                    BatchInfo("warm-up", 0, {1: "warm"}),
                )
            df = self.session.read.parquet(str(tmp / "a" / "changes" / "cache=warm"))
            w = Window.partitionBy("key").orderBy(F.col("version_order").desc())
            df.withColumn("_rank", F.row_number().over(w)).where(F.col("_rank") == 1).write.parquet(str(tmp / "b"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def jvm_cpu_s(self) -> float:
        """CPU seconds (user + system) the Spark JVM and its processes (the Python workers that run
        the writer's tasks) have used so far: the JVM's own, its reaped children's, and each live
        descendant's."""
        if self.session is None:
            return 0.0
        if self._jvm_pid is None:
            self._jvm_pid = int(self.session._jvm.java.lang.ProcessHandle.current().pid())
        return sum(map(_cpu_s, _descendants(self._jvm_pid)))

    def jvm_own_cpu_s(self) -> float:
        """CPU seconds of the JVM's own threads alone (task scheduling, broadcasts, its JIT compilers and
        collector), without the Python workers ``jvm_cpu_s`` adds."""
        if self.session is None:
            return 0.0
        if self._jvm_pid is None:
            self._jvm_pid = int(self.session._jvm.java.lang.ProcessHandle.current().pid())
        return cpu_s(self._jvm_pid, reaped_children=False)

    def release(self) -> None:
        if self.session is not None:
            from cdcd.lake import spark as spark_session

            self.session = None
            self._jvm_pid = None
            spark_session.release()


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children; 0 if it is gone."""
    try:
        return cpu_s(pid, reaped_children=True)
    except OSError:
        return 0.0


def _descendants(root: int) -> list[int]:
    """``root`` and every live process below it."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        out.extend(frontier)
    return out


SPARK = SharedSpark()


def lake_value(k: int) -> dict[str, Any]:
    """A ~100-byte dict value (99 bytes of MessagePack, ~130 of JSON)."""
    return {
        "id": k,
        "name": f"user-{k:08d}",
        "email": f"user{k:08d}@example.com",
        "score": k * 0.25,
        "active": True,
        "tags": ["bench", "lake"],
    }
