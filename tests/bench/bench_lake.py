"""The Spark lake sink: backlog ingest rate, live end-to-end lag to the lake, compaction time.

All three share one in-process SparkSession (``tests/support/lake_bench.py``, also used by
``bench_pg``'s ``catchup.lake``; master ``local[2]``, the sink's
default settings), created once when the first lake benchmark's setup runs and kept until exit
(the sink's own start()/stop() per repetition then only take and drop a reference). Its cold
start-up (``spark_startup_s``: session plus a first trivial job) and a warm-up (``spark_warmup_s``:
a 10k-row landing and a small window query, so class loading and code generation of both paths
are out of the timings) are reported separately and never inside a timing.
Work dirs live under ``$CDCD_BENCH_DIR`` or the system temp dir.

Every lake benchmark runs with the default ``writer = "spark"`` (``createDataFrame`` +
``write.parquet`` on ``local[2]``, delta-rs commits) and, as ``*.deltalake``, with the JVM-free
``writer = "deltalake"`` (pyarrow writes, delta-rs commits).

- ``lake.ingest``: the backlog (setup, untimed): a node dir written by a ``Node`` in background
  mode with 16 MiB segments, ``wal_force_archive_timeout_ms=0``, ``archive_max_bytes=0``: fresh
  int keys, ~100-byte dict values (``lake_value``: 99 bytes of MessagePack), ``put_all``
  transactions of 10 entries, then ``force_archive()`` and ``close()``; 2M entries (200k with
  ``--quick``). Before every repetition the CDC links are restored from the archive and the
  daemon's state dir and the lake are deleted. An in-process ``Daemon`` with a
  ``LakeConsumer`` (``start()`` untimed) then lands the whole backlog; timed is
  ``sync_once()`` (``lake.ingest``) or ``run()`` as an asyncio task until the committed position
  passes the last segment (``lake.ingest.run``). Batches: ``INGEST_BATCH_EVENTS`` events,
  ``INGEST_BATCH_BYTES`` bytes (the best of a 100k-500k sweep, see the constants), and for
  ``run()`` ``batch_max_delay_ms=INGEST_BATCH_DELAY_MS``. Each run records where the time went:
  ``spark_s`` (``createDataFrame`` + the Parquet write, from the sink's
  ``cdcd_lake_spark_write_seconds``), ``build_commit_s`` (the rest of the sink's ``on_events``:
  ``build_table``, lake log commit and publish) and ``daemon_s`` (the rest: reading, decoding,
  the daemon's own commits; with ``run()`` these overlap the sink), and CPU per row of this
  process (``py_cpu_us_per_row``, all threads) and of the Spark JVM with its Python workers, which
  run the writer's tasks (``jvm_cpu_us_per_row``):
  on a busy machine these move far less than the wall-clock rate.
- ``lake.lag.live``: a writer subprocess (this module's ``lag-writer``: a node with
  ``wal_mode=fsync``, ``wal_force_archive_timeout_ms=1000``, ``put_all`` of 10 fresh keys with
  ``lake_value`` values at a fixed 5k entries/s) and an in-process ``Daemon.run()`` with the
  Spark sink and ``batch_max_delay_ms=200``, started before the writer begins. The writer writes
  for 20 s (8 s with ``--quick``), idles 2.5 s so its last segment rolls on the timeout like the
  others, and exits; once the daemon has consumed every CDC link it is stopped. Lag of a row =
  its lake log entry's ``committed_ns`` (the commit point; publishing is a rename or two after
  it) minus the row's ``commit_ts`` read back from the entry's Parquet files with pyarrow (Delta: the
  commit file's mtime, the moment it became visible). Rows
  committed in the first 5 s (3 s) are dropped. p50/p99/max in ms.
- Compaction (``lake.merge``, ``lake.compact_caches``) is in ``bench_lake_merge.py``.

Run as a script, this module is the lag benchmark's writer:
``python -m tests.bench.bench_lake lag-writer --node-dir D --rate 5000 --seconds 20 --go-file G --out F``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.wal.segment import list_segments
from tests.support.bench import Bench, Measurement, Metric, _child_env, _tail
from tests.support.lake_bench import (
    APP_NAME,
    INGEST_BATCH_BYTES,
    INGEST_BATCH_DELAY_MS,
    INGEST_BATCH_EVENTS,
    SPARK,
    SPARK_MASTER,
    ingest_config,
    lake_value,
)
from tests.support.lake_bench import bench_dir as _bench_dir
from tests.support.pacing import Pacer

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_BYTES = 16 << 20
TX_SIZE = 10

INGEST_GOAL = 300_000.0
LAG_RATE = 5000
LAG_FORCE_ARCHIVE_MS = 1000
LAG_BATCH_DELAY_MS = 200
LAG_GOAL_MS = 1500.0
RT_LAG_GOAL_MS = 300.0
LAG_IDLE_S = 2.5
DRAIN_TIMEOUT_S = 120.0


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


def _links(cdc_dir: Path) -> dict[int, Path]:
    return list_segments(cdc_dir)[0]


def _percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    idx = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return float(sorted_values[idx])


def _spark_write_totals() -> tuple[float, float]:
    """(sum of seconds, count) of the sink's Spark writes so far in this process."""
    name = "cdcd_lake_spark_write_seconds"
    return REGISTRY.get_sample_value(f"{name}_sum") or 0.0, REGISTRY.get_sample_value(f"{name}_count") or 0.0


def _consumer(lake: Path, writer: str) -> Any:
    from cdcd.lake.sink import LakeConsumer, LakeOptions

    class TimedSparkConsumer(LakeConsumer):
        """The sink, plus the wall time spent in ``on_events`` and the number of batches."""

        def __init__(self, options: LakeOptions) -> None:
            super().__init__(options)
            self.on_events_s = 0.0
            self.batches = 0

        def on_events(self, batch: Any) -> bool:
            t0 = time.perf_counter()
            try:
                return super().on_events(batch)
            finally:
                self.on_events_s += time.perf_counter() - t0
                self.batches += 1

    return TimedSparkConsumer(
        LakeOptions(
            lake_path=str(lake),
            spark_master=SPARK_MASTER,
            app_name=APP_NAME,
            writer=writer,  # type: ignore[arg-type]
            compact_interval_s=0,  # landing is timed, not maintenance
            optimize_interval_s=0,
        )
    )


def _lake_rows(lake: Path) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(str(lake / "changes")).count())


# --- the backlog ----------------------------------------------------------------------------------
class Backlog:
    """One node whose archive holds ``entries`` entries with ``lake_value`` values (written once)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.entries = 0
        self.last_segment = -1
        self.write_s = 0.0

    @property
    def node_dir(self) -> Path:
        assert self.root is not None, "backlog not written"
        return self.root / "node"

    def ensure(self, entries: int) -> None:
        if self.root is not None and self.entries == entries:
            return
        self.cleanup()
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-", dir=_bench_dir()))
        atexit.register(self.cleanup)
        t0 = time.perf_counter()
        node = Node.open(
            self.node_dir,
            wal_mode="background",
            wal_segment_size_bytes=SEGMENT_BYTES,
            wal_force_archive_timeout_ms=0,
            archive_max_bytes=0,
        )
        try:
            put_all = node.cache("bench").put_all
            for start in range(0, entries, TX_SIZE):
                put_all({k: lake_value(k) for k in range(start, min(start + TX_SIZE, entries))})
            node.force_archive()
        finally:
            node.close()
        self.write_s = time.perf_counter() - t0
        self.entries = entries
        self.last_segment = max(_links(self.node_dir / "cdc"))

    def restore(self) -> int:
        """Every CDC link back, no daemon state, no lake; returns the last segment."""
        cdc = self.node_dir / "cdc"
        links = _links(cdc)
        for idx, path in list_segments(self.node_dir / "wal" / "archive")[0].items():
            if idx not in links:
                os.link(path, cdc / path.name)
        shutil.rmtree(self.node_dir / "cdcd-state", ignore_errors=True)
        shutil.rmtree(self.lake, ignore_errors=True)
        return self.last_segment

    @property
    def lake(self) -> Path:
        assert self.root is not None
        return self.root / "lake"

    def cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.entries = 0


BACKLOG = Backlog()


# --- lake.ingest ----------------------------------------------------------------------------------
async def _run_until(daemon: Daemon, last_segment: int) -> float:
    """``run()`` as a task until the committed position passes ``last_segment``; returns the seconds."""
    t0 = time.perf_counter()
    task = asyncio.create_task(daemon.run(), name="bench-lake-run")
    while True:
        pos = daemon.state.position
        if pos is not None and pos.segment > last_segment:
            break
        if task.done():
            task.result()
            raise RuntimeError(f"run() returned at {pos} before passing segment {last_segment}")
        await asyncio.sleep(0.005)
    seconds = time.perf_counter() - t0
    daemon.stop()
    await task
    return seconds


def run_ingest(
    *,
    entries: int,
    form: str,
    writer: str = "spark",
    batch_events: int = INGEST_BATCH_EVENTS,
    batch_delay_ms: int = INGEST_BATCH_DELAY_MS,
) -> Measurement:
    last = BACKLOG.restore()
    SPARK.ensure()
    consumer = _consumer(BACKLOG.lake, writer)
    config = ingest_config(BACKLOG.node_dir, batch_events=batch_events, batch_delay_ms=batch_delay_ms)
    daemon = Daemon(config, consumer, show_progress=False)
    try:
        t0 = time.perf_counter()
        daemon.start()
        start_s = time.perf_counter() - t0
        spark0, writes0 = _spark_write_totals()
        cpu0, jvm0 = time.process_time(), SPARK.jvm_cpu_s()
        if form == "run":
            seconds = asyncio.run(_run_until(daemon, last))
        else:
            t0 = time.perf_counter()
            daemon.sync_once()
            seconds = time.perf_counter() - t0
            pos = daemon.state.position
            if pos is None or pos.segment <= last:
                raise RuntimeError(f"sync_once() stopped at {pos} before passing segment {last}")
        cpu, jvm = time.process_time() - cpu0, SPARK.jvm_cpu_s() - jvm0
        spark1, writes1 = _spark_write_totals()
        delivered = daemon.events_delivered
    finally:
        daemon.close()
    rows = _lake_rows(BACKLOG.lake)
    if delivered != entries or consumer.rows_written != entries or rows != entries:
        raise AssertionError(
            f"backlog {entries:,}: delivered {delivered:,}, written {consumer.rows_written:,}, lake log {rows:,}"
        )
    spark_s = spark1 - spark0
    extra: dict[str, Any] = {
        "batches": consumer.batches,
        "spark_writes": int(writes1 - writes0),
        "spark_s": round(spark_s, 2),
        "build_commit_s": round(consumer.on_events_s - spark_s, 2),
        "daemon_s": round(seconds - consumer.on_events_s, 2),
        "sink_start_s": round(start_s, 2),
        "spark_startup_s": SPARK.startup_s,
        "spark_warmup_s": SPARK.warmup_s,
        "py_cpu_us_per_row": round(cpu / entries * 1e6, 2),
        "jvm_cpu_us_per_row": round(jvm / entries * 1e6, 2),
        "lake_mib": round(sum(p.stat().st_size for p in BACKLOG.lake.rglob("*.parquet")) / (1 << 20), 1),
        "delta_commits": len(list((BACKLOG.lake / "changes" / "_delta_log").glob("*.json"))) - 1,
    }
    return Measurement(entries, seconds, extra)


# --- lake.lag.live --------------------------------------------------------------------------------
def _lag_writer(node_dir: str, rate: int, seconds: float, idle_s: float, go_file: str, out: str) -> None:
    """Open the node, wait for ``go_file``, then write ``rate`` entries/s (``put_all`` of 10 fresh keys)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = Node.open(
        node_dir,
        wal_mode="fsync",
        wal_segment_size_bytes=SEGMENT_BYTES,
        wal_force_archive_timeout_ms=LAG_FORCE_ARCHIVE_MS,
        archive_max_bytes=0,
    )
    written = 0
    elapsed = behind_max = 0.0
    try:
        put_all = node.cache("lag").put_all
        deadline = time.monotonic() + 60
        while not os.path.exists(go_file):
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError(f"no {go_file} after 60 s")
            time.sleep(0.005)
        pacer = Pacer(rate, TX_SIZE, seconds, stop.is_set)
        for key in pacer:
            put_all({k: lake_value(k) for k in range(key, key + TX_SIZE)})
        written, elapsed, behind_max = pacer.written, pacer.elapsed_s, pacer.behind_max_s
        stop.wait(idle_s)  # the last segment rolls on the force-archive timeout, as every other one did
    finally:
        node.close()
    Path(out).write_text(
        json.dumps({"written": written, "seconds": elapsed, "behind_max_ms": round(behind_max * 1e3, 1)})
    )


async def _drive_lag(daemon: Daemon, writer: subprocess.Popen[bytes], go: Path, cdc: Path, timeout_s: float) -> None:
    task = asyncio.create_task(daemon.run(), name="bench-lake-lag")
    try:
        await asyncio.sleep(0.5)  # the daemon's first pass is up and watching the CDC dir
        go.touch()
        deadline = time.monotonic() + timeout_s
        while writer.poll() is None or _links(cdc):
            if task.done():
                task.result()
                raise RuntimeError("run() returned before the writer's data was landed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"after {timeout_s:.0f}s: writer rc={writer.poll()}, links {sorted(_links(cdc))}")
            await asyncio.sleep(0.02)
    finally:
        daemon.stop()
        await task


def _lake_lags(lake: Path) -> tuple[list[int], list[int], list[int]]:
    """Per row: commit ts (ns) and lag (the Delta commit's timestamp - commit ts); per commit: rows.

    The commit's timestamp is taken from its log file's mtime (ns; commitInfo only has ms): the
    moment the commit became visible to readers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    changes = lake / "changes"
    ts_all: list[int] = []
    lags: list[int] = []
    rows: list[int] = []
    for commit in sorted((changes / "_delta_log").glob("*.json")):
        visible_ns = commit.stat().st_mtime_ns
        adds = [json.loads(line)["add"] for line in commit.read_text().splitlines() if line.startswith('{"add"')]
        if not adds:
            continue
        n = 0
        for add in adds:
            col = pq.read_table(changes / add["path"], columns=["commit_ts"]).column("commit_ts")
            if col.type.tz is None:
                col = col.cast(pa.timestamp(col.type.unit, tz="UTC"))
            ts = col.cast(pa.timestamp("ns", tz="UTC")).cast(pa.int64()).to_pylist()
            ts_all += ts
            lags += [visible_ns - t for t in ts]
            n += len(ts)
        rows.append(n)
    return ts_all, lags, rows


def run_lag(*, seconds: float, drop_s: float, rate: int, lake_writer: str = "spark") -> Measurement:
    SPARK.ensure()
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-lag-", dir=_bench_dir()))
    try:
        node_dir, lake = work / "node", work / "lake"
        go, writer_out, writer_log = work / "go", work / "writer.json", work / "writer.log"
        with writer_log.open("wb") as wlog:
            writer = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.bench.bench_lake", "lag-writer", "--node-dir", str(node_dir)),
                    *("--rate", str(rate), "--seconds", str(seconds), "--idle-seconds", str(LAG_IDLE_S)),
                    *("--go-file", str(go), "--out", str(writer_out)),
                ],
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=wlog,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while not (node_dir / "cdc").is_dir():
                if writer.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lag writer did not open its node:\n{_tail(writer_log)}")
                time.sleep(0.01)
            consumer = _consumer(lake, lake_writer)
            config = DaemonConfig(
                node_dir=str(node_dir),
                metrics_address="",
                batch_max_delay_ms=LAG_BATCH_DELAY_MS,
                consumer={"kind": "lake"},
            )
            daemon = Daemon(config, consumer, show_progress=False)
            try:
                daemon.start()
                spark0, writes0 = _spark_write_totals()
                asyncio.run(_drive_lag(daemon, writer, go, node_dir / "cdc", seconds + LAG_IDLE_S + DRAIN_TIMEOUT_S))
                spark1, writes1 = _spark_write_totals()
            finally:
                daemon.close()
        except BaseException:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            raise
        if writer.returncode != 0:
            raise RuntimeError(f"lag writer exited {writer.returncode}:\n{_tail(writer_log)}")
        stats = json.loads(writer_out.read_text())
        ts, lags, batch_rows = _lake_lags(lake)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(ts) != stats["written"]:
        raise AssertionError(f"the lake holds {len(ts):,} rows, the writer wrote {stats['written']:,}")
    cutoff = min(ts) + int(drop_s * 1e9)
    kept = sorted(lag for t, lag in zip(ts, lags, strict=True) if t >= cutoff)
    if not kept:
        raise AssertionError("no rows after the start-up window")
    window_s = (max(ts) - cutoff) / 1e9
    ms = 1e6
    writes = writes1 - writes0
    extra = {
        "p50_ms": round(_percentile(kept, 50) / ms, 1),
        "p90_ms": round(_percentile(kept, 90) / ms, 1),
        "p99_ms": round(_percentile(kept, 99) / ms, 1),
        "max_ms": round(kept[-1] / ms, 1),
        "min_ms": round(kept[0] / ms, 1),
        "mean_ms": round(statistics.fmean(kept) / ms, 1),
        "batches": len(batch_rows),
        "rows_per_batch": round(statistics.fmean(batch_rows)) if batch_rows else 0,
        "spark_write_ms_mean": round((spark1 - spark0) / writes * 1e3, 1) if writes else None,
        "written": stats["written"],
        "write_rate": round(stats["written"] / stats["seconds"]) if stats["seconds"] else 0,
        "writer_behind_max_ms": stats["behind_max_ms"],
    }
    return Measurement(len(kept), window_s, extra, value=extra["p50_ms"])


def run_rt_lag(*, seconds: float, drop_s: float, rate: int) -> Measurement:
    """The node's realtime worker writing the lake (``writer = "deltalake"``, its default there):
    a node in this process with ``realtime_cdc = true`` and ``cdc_enabled = false`` (no daemon, no
    hand-over needed), ``wal_mode = "fsync"``, written at ``rate`` entries/s (``put_all`` of 10
    fresh keys, open loop); lag as in ``lake.lag.live``."""
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-lake-rt-", dir=_bench_dir()))
    try:
        lake = work / "lake"
        node = Node.open(
            work / "node",
            wal_mode="fsync",
            wal_segment_size_bytes=SEGMENT_BYTES,
            cdc_enabled=False,
            realtime_cdc=True,
            realtime_consumer={"kind": "lake", "lake_path": str(lake)},
        )
        written = 0
        try:
            put_all = node.cache("lag").put_all
            pacer = Pacer(rate, TX_SIZE, seconds)
            for key in pacer:
                put_all({k: lake_value(k) for k in range(key, key + TX_SIZE)})
            written = pacer.written
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while (_lake_rows(lake) if (lake / "changes" / "_delta_log").is_dir() else 0) < written:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the realtime worker landed {_lake_rows(lake):,} of {written:,} rows")
                time.sleep(0.05)
        finally:
            node.close()
        ts, lags, batch_rows = _lake_lags(lake)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(ts) != written:
        raise AssertionError(f"the lake holds {len(ts):,} rows, the node wrote {written:,}")
    cutoff = min(ts) + int(drop_s * 1e9)
    kept = sorted(lag for t, lag in zip(ts, lags, strict=True) if t >= cutoff)
    ms = 1e6
    extra = {
        "p50_ms": round(_percentile(kept, 50) / ms, 1),
        "p90_ms": round(_percentile(kept, 90) / ms, 1),
        "p99_ms": round(_percentile(kept, 99) / ms, 1),
        "max_ms": round(kept[-1] / ms, 1),
        "batches": len(batch_rows),
        "rows_per_batch": round(statistics.fmean(batch_rows)) if batch_rows else 0,
        "written": written,
    }
    return Measurement(len(kept), (max(ts) - cutoff) / 1e9, extra, value=extra["p50_ms"])


# --- registration ---------------------------------------------------------------------------------
def benchmarks(quick: bool) -> list[Bench]:
    entries = 200_000 if quick else 2_000_000
    lag_seconds, lag_drop_s = (8.0, 3.0) if quick else (20.0, 5.0)
    spark = {"spark_master": SPARK_MASTER}
    shape = {"tx_size": TX_SIZE, "value": "dict, 99 B msgpack", "wal_segment_size_bytes": SEGMENT_BYTES}

    def ingest_setup() -> None:
        SPARK.ensure()
        BACKLOG.ensure(entries)

    def ingest(name: str, form: str, goal: float | None, max_repeats: int, last: bool, writer: str) -> Bench:
        more: tuple[Metric, ...] = (Metric("write_s", "spark_s", "s"), Metric("build_commit_s", "build_commit_s", "s"))
        if name == "lake.ingest":
            more += (Metric("spark_startup", "spark_startup_s", "s"), Metric("spark_warmup", "spark_warmup_s", "s"))
        teardown = BACKLOG.cleanup if last else None
        return Bench(
            name=name,
            description=(
                f"Daemon.{form}() landing a {_label(entries)}-entry backlog in the lake "
                + (f"(writer = spark, {SPARK_MASTER})" if writer == "spark" else "(writer = deltalake)")
            ),
            run_once=lambda: run_ingest(entries=entries, form=form, writer=writer),
            unit="rows/s",
            goal=goal,
            setup=ingest_setup,
            max_repeats=max_repeats,
            more=more,
            teardown=teardown,
            params={
                "entries": entries,
                "form": form,
                "writer": writer,
                "batch_max_events": INGEST_BATCH_EVENTS,
                "batch_max_bytes": INGEST_BATCH_BYTES,
                **({"batch_max_delay_ms": INGEST_BATCH_DELAY_MS} if form == "run" else {}),
                **spark,
                **shape,
            },
        )

    return [
        ingest("lake.ingest", "sync_once", INGEST_GOAL, 1 if quick else 2, last=False, writer="spark"),
        ingest("lake.ingest.run", "run", INGEST_GOAL, 1, last=False, writer="spark"),
        ingest("lake.ingest.deltalake", "sync_once", INGEST_GOAL, 1 if quick else 2, last=False, writer="deltalake"),
        ingest("lake.ingest.deltalake.run", "run", INGEST_GOAL, 1, last=True, writer="deltalake"),
        *(
            Bench(
                name="lake.lag.live" + ("" if writer == "spark" else ".deltalake"),
                description=(
                    f"commit-to-lake lag, node writing {LAG_RATE} entries/s (force-archive {LAG_FORCE_ARCHIVE_MS} ms), "
                    f"Daemon.run() + writer = {writer}, {lag_seconds:.0f}s"
                ),
                run_once=functools.partial(
                    run_lag, seconds=lag_seconds, drop_s=lag_drop_s, rate=LAG_RATE, lake_writer=writer
                ),
                metric="p50",
                unit="ms",
                setup=SPARK.ensure,
                max_repeats=1,
                more=(
                    Metric("p99", "p99_ms", "ms", LAG_GOAL_MS, lower_is_better=True),
                    Metric("max", "max_ms", "ms"),
                ),
                params={
                    "rate": LAG_RATE,
                    "seconds": lag_seconds,
                    "dropped_s": lag_drop_s,
                    "wal_force_archive_timeout_ms": LAG_FORCE_ARCHIVE_MS,
                    "batch_max_delay_ms": LAG_BATCH_DELAY_MS,
                    "writer": writer,
                    **spark,
                    **shape,
                },
            )
            for writer in ("spark", "deltalake")
        ),
        Bench(
            name="lake.lag.realtime",
            description=(
                f"commit-to-lake lag of the node's realtime worker (writer = deltalake), {LAG_RATE} entries/s, "
                f"{lag_seconds:.0f}s"
            ),
            run_once=functools.partial(run_rt_lag, seconds=lag_seconds, drop_s=lag_drop_s, rate=LAG_RATE),
            metric="p50",
            unit="ms",
            max_repeats=1,
            more=(
                Metric("p99", "p99_ms", "ms", RT_LAG_GOAL_MS, lower_is_better=True),
                Metric("max", "max_ms", "ms"),
            ),
            params={"rate": LAG_RATE, "seconds": lag_seconds, "dropped_s": lag_drop_s, "wal_mode": "fsync", **shape},
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.bench_lake")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("lag-writer", help="the lag benchmark's writer process")
    w.add_argument("--node-dir", required=True)
    w.add_argument("--rate", type=int, default=LAG_RATE)
    w.add_argument("--seconds", type=float, default=20.0)
    w.add_argument("--idle-seconds", type=float, default=LAG_IDLE_S)
    w.add_argument("--go-file", required=True)
    w.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from cdcd.logging import configure as configure_logging

    configure_logging("json", "warning")
    _lag_writer(args.node_dir, args.rate, args.seconds, args.idle_seconds, args.go_file, args.out)


if __name__ == "__main__":
    main()
