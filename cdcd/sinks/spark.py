"""``kind = "spark"``: batches through Spark into a Parquet change log, exactly once (DESIGN §7)."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

from cdcd import metrics
from cdcd.config import convert
from cdcd.consumer import CacheInfo, Consumer, EventBatch, RecordSlice
from cdcd.durable import write_atomic
from cdcd.lake import spark as spark_session
from cdcd.lake.arrow import build_table, filter_slices, split_slices
from cdcd.lake.log import CacheStats, LakeLog, LakeLogConflict, LogEntry, check_writable, new_batch_id
from cdcd.lake.parquet import write_partitioned
from cdcd.secrets import mask_mapping
from cdcd.wal.pointer import WalPosition

log = structlog.get_logger("cdcd.lake")


_MIN_ROWS_PER_FILE = 100_000
"""Smaller batches are written as one file per partition (smaller files cost readers more)."""


class LakeWriteError(RuntimeError):
    """Spark could not write a batch (one line: the root cause, e.g. No space left on device)."""


def root_cause(exc: BaseException) -> str:
    """The innermost cause of a (Py4J-wrapped Java) exception, on one line."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            while java.getCause() is not None:
                java = java.getCause()
            return str(java.toString()).splitlines()[0]
        except Exception as inner:  # the JVM may be gone; fall back to the Python text
            log.debug("java_cause_unavailable", error=str(inner))
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class SparkOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lake_path: str
    spark_master: str = "local[*]"
    """Any Spark master URL: local[N], spark://host:port, yarn, k8s://... (the lake must be a path
    every executor and this process see, e.g. a shared mount)."""
    spark_conf: dict[str, str] = msgspec.field(default_factory=dict)
    app_name: str = "cdcd-lake"
    partition_by_day: bool = False
    max_files_per_batch: int = 2
    """At most this many files per batch and partition (Spark: coalesced; arrow: parts of >= 100k rows)."""
    writer: Literal["arrow", "spark"] = "arrow"
    """Who writes the change files: pyarrow in this process (no JVM in the daemon or the node, ~2x the
    ingest rate and a third of the lag on a small machine), or Spark (``createDataFrame`` +
    ``write.parquet`` on ``spark_master``: Parquet encoding on a cluster's executors). The files
    are the same either way and a lake may mix them; ``lake compact`` always runs on Spark."""

    def __post_init__(self) -> None:
        # A URL would otherwise become a relative directory (``./s3:/bucket``) and the data land on a local disk.
        if _URL_SCHEME.match(self.lake_path):
            raise msgspec.ValidationError(
                f"{self.lake_path!r} is a URL; the lake sink writes to a path (mount object storage, "
                "e.g. with s3fs or a FUSE driver, and give the mount point) - at `$.lake_path`"
            )


_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class SparkLakeConsumer(Consumer):
    def __init__(self, options: SparkOptions) -> None:
        self.options = options
        self.lake = Path(options.lake_path)
        self._log: LakeLog | None = None
        self._spark: Any = None
        self.rows_written = 0
        self.batches_skipped = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> SparkLakeConsumer:
        return cls(convert(options, SparkOptions, source))

    def start(self, registry: Any = None) -> None:
        metrics.export(metrics.LAKE)
        check_writable(self.lake)
        self._log = LakeLog(self.lake, keep_entries=False)
        self._log.recover()
        opts = self.options
        log.info(
            "lake_sink_starting",
            lake=str(self.lake),
            writer=opts.writer,
            spark_master=opts.spark_master,
            spark_conf=mask_mapping(opts.spark_conf),
            committed_batches=self._log.entry_count,
        )
        if opts.writer == "spark":
            self._spark = spark_session.acquire(opts.spark_master, opts.app_name, opts.spark_conf)

    def stop(self) -> None:
        if self._spark is not None:
            self._spark = None
            spark_session.release()

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        path = self.lake / "_cdcd_caches.json"
        known: dict[str, Any] = {}
        if path.exists():
            known = json.loads(path.read_text())
        for info in caches:
            known[str(info.cache_id)] = {"name": info.name, "partitions": info.config.partitions}
        write_atomic(path, json.dumps(known, sort_keys=True).encode())

    def on_events(self, batch: EventBatch) -> bool:
        lake_log = self._log
        if lake_log is None or (self._spark is None and self.options.writer == "spark"):
            raise RuntimeError("spark sink used before start()")
        while True:
            lake_log.refresh()
            slices = filter_slices(batch, lake_log.high_water.get(batch.source_node))
            rows = sum(s.end - s.start for s in slices)
            if rows < len(batch):
                metrics.LAKE_DUPLICATE_BATCHES.inc()
                self.batches_skipped += 1
                log.info("lake_replay_dropped", events=len(batch) - rows, source=batch.source_node)
            if rows == 0:
                return True
            try:
                self._land(batch, slices)
                return True
            except LakeLogConflict as exc:
                metrics.LAKE_CONFLICTS.inc()
                log.warning("lake_commit_conflict", detail=str(exc))

    def _land(self, batch: EventBatch, slices: list[RecordSlice]) -> None:
        assert self._log is not None
        opts = self.options
        batch_id = new_batch_id()
        staging = self._log.staging / batch_id
        partitions = ["cache", "day"] if opts.partition_by_day else ["cache"]
        rows = sum(s.end - s.start for s in slices)
        t0 = time.perf_counter()
        try:
            if opts.writer == "arrow":
                written, stats = self._write_arrow(slices, batch, staging, partitions, batch_id)
            else:
                written, stats = self._write_spark(slices, batch, staging, partitions)
        except Exception as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise LakeWriteError(f"writing {rows} rows to {staging} failed: {root_cause(exc)}") from None
        metrics.LAKE_WRITE_SECONDS.observe(time.perf_counter() - t0)
        first, last = slices[0], slices[-1]
        entry = LogEntry(
            seq=0,
            batch=batch_id,
            source=batch.source_node,
            first=WalPosition(first.pointer.segment, first.pointer.offset, first.start),
            last=WalPosition(last.pointer.segment, last.pointer.offset, last.end - 1),
            files=written,
            caches={name: CacheStats(n, ts) for name, (n, ts) in stats.items()},
            committed_ns=0,
        )
        try:
            entry = self._log.commit(entry)
        except BaseException:
            if self._log.linked_batch != batch_id:  # not committed: its files must never appear
                shutil.rmtree(staging, ignore_errors=True)
            raise
        self._log.publish(entry)
        self.rows_written += rows
        for name, (n, _ts) in stats.items():
            metrics.LAKE_ROWS.labels(name).inc(n)
        metrics.LAKE_LAG_SECONDS.set(max(0.0, time.time() - batch.last_commit_ts_ns / 1e9))

    def _write_spark(
        self, slices: list[RecordSlice], batch: EventBatch, staging: Path, partitions: list[str]
    ) -> tuple[list[str], dict[str, tuple[int, int]]]:
        table, stats = build_table(slices, batch, batch.source_node, self.options.partition_by_day)
        files = max(1, min(self.options.max_files_per_batch, table.num_rows // 250_000 + 1))
        df = self._spark.createDataFrame(table)
        df.coalesce(files).write.partitionBy(*partitions).parquet(str(staging))
        written = [str(p.relative_to(staging)) for p in staging.rglob("*.parquet") if not p.name.startswith((".", "_"))]
        return sorted(written), stats

    def _write_arrow(
        self, slices: list[RecordSlice], batch: EventBatch, staging: Path, partitions: list[str], batch_id: str
    ) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """Up to ``max_files_per_batch`` parts, each built while the previous one is written:
        pyarrow's Parquet encoding and compression run without the GIL, on the other core."""
        parts = split_slices(slices, self.options.max_files_per_batch, min_rows=_MIN_ROWS_PER_FILE)
        prefix = f"part-{batch_id.rsplit('-', 1)[-1]}"
        stats: dict[str, tuple[int, int]] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="cdcd-lake-write") as pool:
            futures = []
            for i, part in enumerate(parts):
                table, part_stats = build_table(part, batch, batch.source_node, self.options.partition_by_day)
                futures.append(pool.submit(write_partitioned, table, staging, partitions, f"{prefix}-{i}"))
                for name, (n, ts) in part_stats.items():
                    rows, max_ts = stats.get(name, (0, 0))
                    stats[name] = (rows + n, max(max_ts, ts))
            written = [rel for f in futures for rel in f.result()]
        return sorted(written), stats
