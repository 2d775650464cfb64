"""``kind = "lake"``: batches into the Delta table ``<lake>/changes``, exactly once.

The Parquet files are written by Spark tasks on ``spark_master`` (``writer = "spark"``, the default:
each task writes its part of the batch straight into the table, cdcd/lake/landing/spark_write.py) or by
pyarrow in this process (``writer = "deltalake"``, no JVM: the node's realtime worker and small
machines); delta-rs commits either way (cdcd/lake/landing/delta.py says why and how the commit is exactly
once).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec
import pyarrow as pa
import structlog
from deltalake.exceptions import DeltaError

from cdcd import failpoints, metrics
from cdcd.config import check_ranges, convert
from cdcd.consumer import CacheDrop, CacheInfo, Consumer, EventBatch, RecordSlice, ResumeAt, RetriableError
from cdcd.delivery import slices_from
from cdcd.lake import spark as spark_session
from cdcd.lake.landing.arrow import build_table, split_slices, truncate_table
from cdcd.lake.landing.checkpointer import Checkpointer, checkpoint_interval
from cdcd.lake.landing.delta import ChangeTable, LakeWriteError, SourceMark, WrittenFiles
from cdcd.lake.landing.spark_write import BatchInfo, PartFiles, write_on_executors
from cdcd.lake.maintenance.autocompact import FilePolicy, Rewriter
from cdcd.lake.maintenance.compact import compact, compact_engine
from cdcd.lake.maintenance.feed import require_live_files
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
from cdcd.lake.registry import record_caches
from cdcd.lake.storage import LakeDir, LakeLocation, LakeStorageError, StorageOptions, check_writable
from cdcd.lake.typed.declared import DeclaredSchemaError, DeclaredTable, TableOptions, check_declared
from cdcd.lake.typed.probe import top_level_fields
from cdcd.logging import describe
from cdcd.secrets import mask_mapping
from cdcd.wal.pointer import WalPointer, WalPosition

log = structlog.get_logger("cdcd.lake")

__all__ = ["LakeBehind", "LakeConsumer", "LakeOptions", "LakeWriteError", "root_cause"]

WRITE_AHEAD_COMMITTED = "lake.write_ahead.committed"
"""Fail point (cdcd/failpoints.py) after the batch written ahead committed, the next one's Spark job running."""

MAX_FILES_PER_BATCH = 1024
"""More parts than this are never faster (each is a task and a file per partition): a typo."""

_MIN_ROWS_PER_FILE = 100_000
"""Smaller batches are written as one file per partition (smaller files cost readers more)."""


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


def _io_error(cause: str) -> bool:
    """Whether a Spark task's root cause is an I/O error of the disk or the store (waiting may cure it)."""
    return any(
        name in cause
        for name in ("IOException", "SocketException", "ConnectException", "SdkClientException", "Timeout")
    )


class LakeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lake_path: str
    spark_master: str | None = None
    """Any Spark master URL: local[N], spark://host:port, yarn, k8s://... (with the Spark writer on a
    cluster the lake is an object store, or a path every executor and this process see). Unset: ``local[*]``
    (``master``); named, it also makes ``compact_engine = "auto"`` compact on Spark."""
    spark_conf: dict[str, str] = msgspec.field(default_factory=dict)
    app_name: str = "cdcd-lake"
    partition_by_day: bool = False
    max_files_per_batch: int = 2
    """A batch is written in up to this many parts (of at least 100k rows), each one file per
    partition: the parts are written side by side (two cores, or Spark tasks on free executors)."""
    writer: Literal["spark", "deltalake"] = "spark"
    """Who writes the Parquet files: Spark on ``spark_master`` (default), or pyarrow in this
    process (``"deltalake"``): no JVM, for small machines and the
    node's realtime worker (its default there). Both land the same table, exactly once, and may
    take turns on it."""

    storage: StorageOptions = msgspec.field(default_factory=StorageOptions)
    """``[consumer.storage]``: endpoint, region, credentials of an object store (``lake_path = "s3://..."``)."""
    compact_interval_s: float = 20.0
    """Run ``lake compact`` (MERGE into ``state`` and the typed tables) from the daemon every this many
    seconds; 0: never. On the engine ``compact_engine`` names.
    In a ``[realtime_consumer]`` table the default is 0: the daemon's sink maintains the lake (it runs
    PASSIVE or not), and the node's process starts no JVM unless asked."""
    optimize_interval_s: float = 10.0
    """Bin-pack small files of every table every this many seconds; 0: never. Live traffic adds about
    one file per cache partition and commit; this bounds the files a partition holds. Default 0 in a
    ``[realtime_consumer]`` table, as ``compact_interval_s``."""
    max_files_per_partition: int = 20
    """Files (below 64 MiB) per partition of ``changes``, ``state`` and each typed table, at most, at every
    moment: the writer rewrites the partitions a commit touched, by size tiers, once one holds too many
    (cdcd/lake/maintenance/autocompact.py); compaction does the same to ``state`` and the typed tables after each run.
    0: off (files then wait for the scheduled OPTIMIZE)."""
    compact_file_rows: int = 65_536
    """Rows per file of ``state``'s cache partitions and the typed tables, which compaction keeps sorted by key
    in files of bounded key ranges, so a run rewrites only the files its changed keys fall in
    (cdcd/lake/maintenance/clustered.py); such key-disjoint files count as one toward ``max_files_per_partition``."""
    compact_max_rows: int = 1_000_000
    """Change rows one compaction folds at most (whole commits: a larger one alone); the rest waits for the next
    run, which starts at once. A run's seconds and memory then follow this bound, not a backlog's size (the
    first run after an outage, a catch-up), and no run holds the compaction lane for long. 0: no bound."""
    ready_within_s: float = 15.0
    """A new cache's typed table and its rows in ``state`` answer ``cdcd lake sql`` within this long of its first
    commit (compaction on): the first commit of a cache makes the next compaction due within a second; a cache
    that took longer is logged (``lake_new_cache_ready`` warning)."""
    compact_engine: Literal["auto", "spark", "deltalake"] = "auto"
    """Who runs compaction: Spark on ``spark_master``, or delta-rs and pyarrow in this process (no JVM).
    ``auto``: Spark with ``writer = "spark"`` or when ``spark_master`` is set, delta-rs otherwise (the
    ``deltalake`` writer stays JVM-free). Both write the same tables."""
    maintenance_max_failures: int = 3
    """Scheduled runs failing in a row before the sink fails (the daemon exits 4 naming the error)."""
    maintenance_nice: int = 0
    """Niceness added to the scheduled maintenance's threads (compaction, the optimize lane; Linux, 0-19): on
    cores shared with delivery, or with the node's realtime worker beside a PASSIVE daemon, their Python and
    pyarrow work gets the CPU those leave (delta-rs's own threads keep the process's priority). 0: the
    process's own priority (at 10 compactions ran longer and the realtime lag did not improve:
    docs/performance.md)."""
    typed_tables: bool = True
    """Scheduled compaction keeps ``<lake>/tables/<cache>`` too (one Delta table per cache); false:
    ``state`` only (thousands of tiny caches: a table each costs a few commits per compaction)."""
    tables: dict[str, TableOptions] = msgspec.field(default_factory=dict)
    """``[consumer.tables.<cache>]``: declared column types of a cache's typed table (docs/lake.md)."""
    vacuum_interval_s: float = 3600.0
    """Delete the files every table no longer needs every this many seconds (the first time five minutes after the
    start), without a JVM: those replaced by the small-file bound, OPTIMIZE and compaction, the typed tables'
    change data feed and orphans of writes that never committed, once older than ``vacuum_retain_hours``
    (cdcd/lake/maintenance/vacuum_rs.py). 0: never (the lake's directory then grows by every file replaced; run
    ``cdcd lake vacuum``). Default 0 in a ``[realtime_consumer]`` table, as ``compact_interval_s``."""
    vacuum_retain_hours: int = 24
    """How long files no snapshot names stay: time travel on ``state`` and the typed tables, their change data
    feed and a query in flight reach back this far, and the lake's directory holds this many hours of replaced
    files besides the live ones. ``changes`` also keeps what compaction has yet to read. At least 1."""
    realtime_commit_interval_ms: int = 100
    """As a node's ``[realtime_consumer]``: its realtime worker commits to the lake at most once per this
    interval, what arrives meanwhile joining the next commit (the node's ``realtime_batch_min_interval_ms`` wins
    when longer). Each commit costs a file per cache partition, the rewrites those make due and a log entry
    every reader lists: a dozen commits a second took most of a core of the node's (docs/performance.md). Costs
    a batch's first entries up to this much more lag. 0: as soon as the last commit returned. The daemon's
    commits are not paced by it."""
    write_ahead_max_s: float = 5.0
    """Spark writer: the Spark job writing a batch's files starts while the batch before it is still being
    written or committed, so the executors never wait for the daemon's next batch nor it for them. The call
    returns before its batch is durable (Ignite's ``onEvents`` returning false) and the daemon moves its
    position once the sink confirms: at once when it has nothing more to deliver (caught up, a switch), and at
    least every this many seconds in a long catch-up, which bounds what a restart reads again. One batch at
    most is written ahead. 0: each batch lands within its own call. Default 0 in a ``[realtime_consumer]``
    table."""

    def __post_init__(self) -> None:
        check_ranges(
            self,
            {
                "max_files_per_batch": 1 <= self.max_files_per_batch <= MAX_FILES_PER_BATCH,
                "compact_file_rows": self.compact_file_rows >= 1,
                "compact_max_rows": self.compact_max_rows >= 0,
                "realtime_commit_interval_ms": 0 <= self.realtime_commit_interval_ms <= 60_000,
                "write_ahead_max_s": 0 <= self.write_ahead_max_s <= 3600,
            },
        )
        try:
            self.maintainer_options()
            self.file_policy()
        except ValueError as exc:
            raise msgspec.ValidationError(str(exc)) from None
        try:
            LakeLocation(self.lake_path, self.storage)
        except LakeStorageError as exc:
            raise msgspec.ValidationError(str(exc)) from None
        try:
            self.declared_tables()
        except DeclaredSchemaError as exc:
            raise msgspec.ValidationError(str(exc)) from None

    def declared_tables(self) -> dict[str, DeclaredTable]:
        return check_declared(self.tables, "consumer.tables")

    @property
    def uses_spark(self) -> bool:
        return self.writer == "spark"

    @property
    def master(self) -> str:
        return self.spark_master or "local[*]"

    @property
    def compacts_on_spark(self) -> bool:
        return compact_engine(self.compact_engine, self.spark_master, spark_writer=self.uses_spark) == "spark"

    def maintainer_options(self) -> MaintainerOptions:
        return MaintainerOptions(
            self.compact_interval_s,
            self.optimize_interval_s,
            self.maintenance_max_failures,
            self.file_policy(),
            self.ready_within_s,
            nice=self.maintenance_nice,
            vacuum_interval_s=self.vacuum_interval_s,
            vacuum_retain_hours=self.vacuum_retain_hours,
        )

    def file_policy(self) -> FilePolicy | None:
        """How files are bounded per partition (None: ``max_files_per_partition = 0``, off)."""
        if not self.max_files_per_partition:
            return None
        return FilePolicy(max_files=self.max_files_per_partition, file_rows=self.compact_file_rows)


def _compact_jvm_free(_spark: Any, lake: LakeDir, **options: Any) -> Any:
    """``compact`` on delta-rs, whatever session the Maintainer holds (the Spark writer's)."""
    return compact(None, lake, **options)


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def split_replayed(
    slices: Sequence[RecordSlice], last: WalPointer | None
) -> tuple[list[RecordSlice], list[RecordSlice]]:
    """(slices at or below ``last`` - landed already, if the history is the same -, the new ones).

    The mark names whole records: everything before the record after ``last`` is landed."""
    if last is None:
        return [], list(slices)
    new = slices_from(slices, WalPosition(last.segment, last.offset + 1))
    return list(slices[: len(slices) - len(new)]), new


class LakeBehind(Exception):
    """The source's mark in the lake went back while this sink ran (the lake restored from a backup,
    its newest commits deleted): what it landed since is gone from the lake. The caller fails; the
    daemon's next start lands it again (``resume_at``)."""


def _mark_key(mark: SourceMark) -> tuple[int, int, int]:
    last = mark.last
    return (mark.generation, -1, -1) if last is None else (mark.generation, last.segment, last.offset)


def _holds(table: ChangeTable, source: str, mark: SourceMark) -> str:
    landed = f"record {mark.last}" if mark.last is not None else "nothing"
    return (
        f"lake table {table.path} at version {table.table.version()} holds node {source} up to {landed} "
        f"(its mark, generation {mark.generation})"
    )


_COMPARED = ["wal_segment", "wal_offset", "wal_index", "op", "key", "value"]


def _by_record(table: pa.Table) -> dict[tuple[int, int], list[tuple[Any, ...]]]:
    out: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
    cols = [table.column(c).to_pylist() for c in _COMPARED]
    for row in zip(*cols, strict=True):
        out.setdefault((row[0], row[1]), []).append(row[2:])
    for rows in out.values():
        rows.sort(key=lambda r: r[0])
    return out


class _Landing(NamedTuple):
    """What of a batch to land, and against which mark of its source."""

    read: SourceMark
    """The source's mark the batch was filtered against; the commit needs it unchanged."""
    new: list[RecordSlice]
    generation: int

    @property
    def rows(self) -> int:
        return sum(s.end - s.start for s in self.new)


class _Ahead:
    """A batch whose files are being written (a Spark job in the sink's writer thread) while the call that
    took it has returned: committed by the next call, or written again whole by it when the write failed."""

    __slots__ = ("batch", "future", "todo")

    def __init__(self, batch: EventBatch, todo: _Landing, future: Future[tuple[WrittenFiles, dict[str, int]]]):
        self.batch = batch
        self.todo = todo
        self.future: Future[tuple[WrittenFiles, dict[str, int]]] | None = future
        """None: the write failed (its error went to a call); the next call lands the batch within itself."""

    def abandon(self) -> None:
        """Wait for the write and delete what it wrote: nothing commits it (its batch is read again from
        the daemon's position, which never passed it)."""
        future, self.future = self.future, None
        if future is None:
            return
        try:
            files, _ = future.result()
        except Exception as exc:  # not the error being reported: logged, not raised over it
            log.warning("lake_write_ahead_failed", rows=self.todo.rows, error=describe(exc))
            return
        files.discard()


class LakeConsumer(Consumer):
    decodes_entries = False  # its row builders read the records' bytes (``RecordSlice.payload``)

    def __init__(self, options: LakeOptions) -> None:
        self.options = options
        self.min_batch_interval_ms = options.realtime_commit_interval_ms
        self.location = LakeLocation(options.lake_path, options.storage)
        self.lake: LakeDir = self.location.root()
        self._table: ChangeTable | None = None
        self._spark: Any = None
        self._maintainer: Maintainer | None = None
        self.rows_written = 0
        self.batches_skipped = 0
        self._landed: dict[str, SourceMark] = {}
        """Per source, the mark this sink last saw or moved: a mark read lower later was lost."""
        self._fields_landed: dict[str, set[str]] = {}
        """The batch being landed: cache -> top-level fields of its values (probed when compaction keeps typed
        tables and the writer holds the values: a known cache's new field makes compaction due soon)."""
        self._rewriter: Rewriter | None = None
        """The bound's rewrites of the partitions commits touched, in a thread of its own beside the commits."""
        self._counts: Counter[tuple[Any, ...]] | None = None
        """Files per partition after this sink's last commit (None: not known): whether the next commit has
        room beside a rewrite that is still running."""
        self._checkpointer: Checkpointer | None = None
        """The checkpoints of ``changes``, in a thread of their own: no commit waits for one."""
        self._writes_ahead = options.uses_spark and options.write_ahead_max_s > 0
        self._ahead: _Ahead | None = None
        """The batch written ahead: its call returned, it is not committed yet (``write_ahead_max_s``)."""
        self._unconfirmed_since: float | None = None
        """When a call last returned before its batch was durable, with none confirmed since (monotonic s)."""
        self._write_pool: ThreadPoolExecutor | None = None
        self._part_files: PartFiles | None = None
        """A local master's tasks read their parts from files here (cdcd/lake/landing/spark_write.py)."""
        self.rewrite_wait_s = 0.0
        """Seconds this sink's commits waited for the rewrite before them (the bound's back-pressure)."""
        self._known: dict[str, tuple[int, SourceMark]] = {}
        """Per source, a version of ``changes`` and the source's mark at it, known without reading the log
        again: the mark read at that version, this sink's own commit (at the version it read plus one) and
        the rewrites after it (they move no mark). Reading a mark replays the log since its last
        checkpoint, as does every refresh: per batch, the sink does each at most once."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> LakeConsumer:
        if "writer" not in options and _is_url(str(options.get("lake_path", ""))):
            options = {**options, "writer": "deltalake"}  # the writer on object stores
        if source.endswith("realtime_consumer"):
            # In the node's process: no JVM unless asked for (the daemon's sink maintains the lake).
            options = {
                "writer": "deltalake",
                "compact_interval_s": 0.0,
                "optimize_interval_s": 0.0,
                "vacuum_interval_s": 0.0,
                "write_ahead_max_s": 0.0,
                **options,
            }
        return cls(convert(options, LakeOptions, source))

    def start(self, registry: Any = None) -> None:
        metrics.export(metrics.LAKE)
        if isinstance(self.lake, Path):
            check_writable(self.lake)
        else:
            self.location.check()  # no such bucket, credentials refused, endpoint down: one line
        table = ChangeTable(self.lake, self.options.partition_by_day)
        table.open()
        # A data file deleted or cut short under the table: stop at once, as lake compact/verify/check do,
        # rather than land on (and compact later) a lake that no longer holds what it claims.
        require_live_files(table.path, table.table)
        table.inline_checkpoints = False
        self._checkpointer = Checkpointer(table.path, checkpoint_interval(table.table.metadata().configuration))
        self._table = table
        opts = self.options
        log.info(
            "lake_sink_starting",
            lake=str(self.lake),
            storage=self.location.masked(),
            writer=opts.writer,
            spark_master=opts.master if opts.uses_spark or opts.compacts_on_spark else None,
            spark_conf=mask_mapping(opts.spark_conf),
            table_version=table.table.version(),
        )
        conf = {**self.location.spark_conf, **opts.spark_conf}
        if opts.uses_spark:
            self._spark = spark_session.acquire(opts.master, opts.app_name, conf)
            if opts.master.startswith("local"):
                self._part_files = PartFiles()
        if opts.compact_interval_s or opts.optimize_interval_s:
            on_spark = opts.compacts_on_spark
            spark_optimize = bool(opts.optimize_interval_s) and opts.file_policy() is None
            if self._spark is None and ((opts.compact_interval_s and on_spark) or spark_optimize):
                # Spark only when asked for: compaction on the Spark engine, or OPTIMIZE without the files
                # bound; the bound's rewrites run on pyarrow and delta-rs (cdcd/lake/maintenance/autocompact.py).
                self._spark = spark_session.acquire(opts.master, opts.app_name, conf)
            compact_fn = functools.partial(
                compact if on_spark else _compact_jvm_free,
                tables=opts.declared_tables(),
                typed_tables=opts.typed_tables,
                file_rows=opts.compact_file_rows,
                max_rows_per_run=opts.compact_max_rows,
            )
            self._maintainer = Maintainer(
                self.lake,  # type: ignore[arg-type]
                self._spark,
                opts.maintainer_options(),
                compact_fn=compact_fn,
            )
            self._maintainer.start()

    def alive(self) -> bool:
        if self._maintainer is not None:
            self._maintainer.check()  # MaintenanceFailed names the cause in the caller's exit line
        return True

    def stop(self) -> None:
        if self._ahead is not None:  # its call returned unconfirmed: the daemon's position is before it
            log.info("lake_write_ahead_dropped", rows=self._ahead.todo.rows, detail="read again at the next start")
            self._ahead.abandon()
            self._ahead = None
        if self._write_pool is not None:
            self._write_pool.shutdown()
            self._write_pool = None
        if self._part_files is not None:
            self._part_files.close()
            self._part_files = None
        if self._rewriter is not None:  # the last commit's rewrite ends (or fails, logged) before the sink does
            self._rewriter.close()
            self._rewriter = None
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        if self._maintainer is not None:
            try:
                self._maintainer.stop()
            except TimeoutError as exc:  # its Spark jobs ignore the cancel: the process ends it (a daemon thread)
                log.warning("lake_maintainer_stop_timeout", error=str(exc))
            self._maintainer = None
        if self._spark is not None:
            self._spark = None
            spark_session.release()

    def resume_at(self, source_node: str, delivered: WalPointer) -> ResumeAt | None:
        """Where to deliver again from when the lake's mark of ``source_node`` is below ``delivered``:
        its marked record (dropped as landed), or the first segment when the lake holds nothing of it."""
        table = self._table
        if table is None:
            raise RuntimeError("lake sink used before start()")
        table.refresh()
        read = table.mark(source_node)
        self._landed[source_node] = read
        if read.last is not None and read.last >= delivered:
            return None
        position = WalPosition(0, 0) if read.last is None else WalPosition(read.last.segment, read.last.offset)
        return ResumeAt(position, _holds(table, source_node, read))

    def _check_not_behind(self, table: ChangeTable, source: str, read: SourceMark) -> None:
        known = self._landed.get(source)
        if known is not None and _mark_key(read) < _mark_key(known):
            landed = f"record {known.last}, generation {known.generation}"
            raise LakeBehind(
                f"{_holds(table, source, read)}, but this sink landed up to {landed}: the lake lost commits "
                "while the sink ran (restored from a backup? newest _delta_log entries deleted?); restart "
                "the daemon, it lands them again from its WAL"
            )
        self._landed[source] = read

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        with self._retriable():  # a store away when a cache first shows up is waited out as for a batch
            self._record_caches(caches)

    def _record_caches(self, caches: Sequence[CacheInfo]) -> None:
        record_caches(self.lake, caches)

    def on_cache_drop(self, drops: Sequence[CacheDrop]) -> None:
        """A ``truncate`` row per drop, in a commit of its own that moves the source's mark to the
        DESTROY record: exactly once as a batch is (a drop at or below the mark landed already).
        The caller commits its position past the drop only after this returns, so landing it with
        the next batch instead could lose it to a crash in between."""
        table = self._table
        if table is None:
            raise RuntimeError("lake sink used before start()")
        with self._retriable():
            self._settle_ahead(table)  # a drop's mark comes after every batch before it
            self._land_drops(table, drops)

    def _land_drops(self, table: ChangeTable, drops: Sequence[CacheDrop]) -> None:
        for drop in drops:
            while True:
                table.refresh()
                read = table.mark(drop.source_node)
                self._check_not_behind(table, drop.source_node, read)
                if read.last is not None and read.last >= drop.position:
                    log.info("lake_drop_landed_before", cache=drop.name, at=str(drop.position))
                    break
                data = truncate_table([drop], self.options.partition_by_day, read.generation)
                files = table.write_arrow(data)
                meta = {"rows": 1, "first": str(drop.position), "truncate": drop.name, "pid": os.getpid()}
                if not self._room_for(table, drop.source_node, read, files.adds):
                    files.discard()
                elif table.commit(
                    files=files,
                    source=drop.source_node,
                    read=read,
                    generation=read.generation,
                    last=drop.position,
                    first=drop.position,
                    metadata=meta,
                ):
                    self._landed[drop.source_node] = SourceMark(read.generation, drop.position)
                    metrics.LAKE_ROWS.labels(drop.name).inc()
                    self._bound_files(table, files.adds)
                    log.info("lake_cache_truncated", cache=drop.name, at=str(drop.position))
                    break
                metrics.LAKE_CONFLICTS.inc()

    def on_events(self, batch: EventBatch) -> bool:
        table = self._table
        if table is None or (self._spark is None and self.options.uses_spark):
            raise RuntimeError("lake sink used before start()")
        if self._maintainer is not None:
            self._maintainer.check()  # scheduled maintenance gave up: fail with its error
        with self._retriable():
            if self._writes_ahead:
                return self._land_ahead(table, batch)
            return self._land(table, batch)

    def _land_ahead(self, table: ChangeTable, batch: EventBatch) -> bool:
        """``write_ahead_max_s``: start writing ``batch``'s files, then commit the batch written ahead by the last
        call; True once nothing is left unconfirmed (a call without events, the bound reached)."""
        ahead = self._ahead
        since = self._unconfirmed_since
        due = since is not None and time.monotonic() - since >= self.options.write_ahead_max_s
        if not len(batch) or due:
            return self._land_in_call(table, batch)
        if ahead is None:
            todo = self._prepare(table, batch)
            if todo is None:
                return True
        else:
            # Filtered against the mark the batch ahead leaves once committed; checked again at its commit.
            expected = SourceMark(ahead.todo.generation, ahead.todo.new[-1].pointer)
            replayed, new = split_replayed(batch.slices, expected.last)
            if replayed or not new:  # not the records after it: each lands in order, within this call
                return self._land_in_call(table, batch)
            todo = _Landing(expected, new, expected.generation)
        following = _Ahead(batch, todo, self._submit(table, batch, todo))
        try:
            self._settle_ahead(table)
        except BaseException:
            following.abandon()
            raise
        self._ahead = following
        if self._unconfirmed_since is None:
            self._unconfirmed_since = time.monotonic()
        return False

    def _land_in_call(self, table: ChangeTable, batch: EventBatch) -> bool:
        """The batch ahead committed, then ``batch`` landed within this call: nothing is left unconfirmed."""
        self._settle_ahead(table)
        self._unconfirmed_since = None
        return self._land(table, batch) if len(batch) else True

    def _submit(
        self, table: ChangeTable, batch: EventBatch, todo: _Landing
    ) -> Future[tuple[WrittenFiles, dict[str, int]]]:
        if self._write_pool is None:
            # Two threads: the batch ahead's job may still run when the next one starts (Spark runs both).
            self._write_pool = ThreadPoolExecutor(2, thread_name_prefix="cdcd-lake-write-ahead")
        return self._write_pool.submit(self._timed_write, table, todo.new, batch, todo.generation)

    def _settle_ahead(self, table: ChangeTable) -> None:
        """The batch written ahead committed (or landed whole again: its write failed, or another writer moved
        its source's mark); nothing is ahead after this returns."""
        ahead = self._ahead
        if ahead is None:
            return
        batch, todo, future = ahead.batch, ahead.todo, ahead.future
        if future is not None:
            ahead.future = None  # taken: should anything from here on fail, the next call lands the batch whole
            files, stats = future.result()
            table.refresh()
            read = self._mark(table, batch.source_node)
            self._check_not_behind(table, batch.source_node, read)
            self._fields_landed = {}
            if read == todo.read and self._finish(table, batch, todo, files, stats):
                self._ahead = None
                failpoints.hit(WRITE_AHEAD_COMMITTED)
                return
            if read != todo.read:
                files.discard()
        self._land(table, batch)
        self._ahead = None

    @contextlib.contextmanager
    def _retriable(self) -> Iterator[None]:
        """The store unreachable, the disk full: the delivery loop offers the batch (or the drop) again,
        and the source's mark in the table drops whatever an attempt did land."""
        try:
            yield
        except (LakeWriteError, OSError) as exc:
            metrics.LAKE_COMMIT_FAILURES.inc()
            if isinstance(exc, OSError) or exc.transient:
                raise RetriableError(f"lake {self.lake}: {describe(exc)}") from exc
            raise

    def _land(self, table: ChangeTable, batch: EventBatch) -> bool:
        """``batch`` landed within this call (the source's mark filters what landed already)."""
        while True:
            todo = self._prepare(table, batch)
            if todo is None:
                return True
            self._fields_landed = {}
            files, stats = self._timed_write(table, todo.new, batch, todo.generation)
            if self._finish(table, batch, todo, files, stats):
                return True

    def _prepare(self, table: ChangeTable, batch: EventBatch) -> _Landing | None:
        """What of ``batch`` to land against the source's mark in the table as it is now (None: all of it
        landed already): a replayed part the lake holds is dropped, one it holds differently starts a new
        generation of the source."""
        source = batch.source_node
        table.refresh()
        read = self._mark(table, source)
        self._check_not_behind(table, source, read)
        replayed, new = split_replayed(batch.slices, read.last)
        generation = read.generation
        if replayed:
            diverged = self._diverged_at(table, batch, read, replayed)
            if diverged is None:
                metrics.LAKE_DUPLICATE_BATCHES.inc()
                self.batches_skipped += 1
                log.info(
                    "lake_replay_dropped",
                    events=sum(s.end - s.start for s in replayed),
                    source=source,
                    landed_until=str(read.last),
                )
            else:
                new = replayed[diverged:] + new
                generation += 1
                metrics.LAKE_GENERATIONS.inc()
                log.warning(
                    "lake_source_diverged",
                    source=source,
                    at=str(replayed[diverged].pointer),
                    landed_until=str(read.last),
                    generation=generation,
                    detail="the record at a landed position is not the record the lake holds "
                    "(node dir restored from a backup?): continuing as a new generation of the source",
                )
        return _Landing(read, new, generation) if new else None

    def _timed_write(
        self, table: ChangeTable, new: list[RecordSlice], batch: EventBatch, generation: int
    ) -> tuple[WrittenFiles, dict[str, int]]:
        t0 = time.perf_counter()
        written = self._write(table, new, batch, generation)
        metrics.LAKE_WRITE_SECONDS.observe(time.perf_counter() - t0)
        return written

    def _finish(
        self, table: ChangeTable, batch: EventBatch, todo: _Landing, files: WrittenFiles, stats: dict[str, int]
    ) -> bool:
        """Commit the files written for ``todo`` (True), or delete them when the source's mark is no longer
        ``todo.read`` (False: another writer landed this source meanwhile; the caller filters the batch again)."""
        source, new, read = batch.source_node, todo.new, todo.read
        rows = todo.rows
        meta = {"rows": rows, "first": str(new[0].pointer), "writer": self.options.writer, "pid": os.getpid()}
        settled = self._room_for(table, source, read, files.adds)
        if not settled:
            files.discard()
        elif table.commit(
            files=files,
            source=source,
            read=read,
            generation=todo.generation,
            last=new[-1].pointer,
            first=new[0].pointer,
            metadata=meta,
        ):
            landed = SourceMark(todo.generation, new[-1].pointer)
            self._landed[source] = landed
            self._committed(table, source, landed, files.adds)
            self.rows_written += rows
            for name, n in stats.items():
                metrics.LAKE_ROWS.labels(name).inc(n)
            metrics.LAKE_LAG_SECONDS.set(max(0.0, time.time() - batch.last_commit_ts_ns / 1e9))
            if self._maintainer is not None:
                self._maintainer.landed(stats, self._fields_landed)
            self._bound_files(table, files.adds)
            return True
        metrics.LAKE_CONFLICTS.inc()
        log.warning("lake_commit_conflict", source=source, detail="another writer landed this source first")
        return False

    def _mark(self, table: ChangeTable, source: str) -> SourceMark:
        """The source's mark in the snapshot ``table`` holds: known (``_known``) or read from it."""
        version = table.table.version()
        known = self._known.get(source)
        if known is not None and known[0] == version:
            return known[1]
        rewriter = self._rewriter
        if known is not None and known[0] < version and rewriter is not None and rewriter.made(known[0] + 1, version):
            self._known[source] = (version, known[1])  # only rewrites came after it: they move no mark
            return known[1]
        read = table.mark(source)
        self._known[source] = (version, read)
        return read

    def _committed(self, table: ChangeTable, source: str, landed: SourceMark, adds: Sequence[Any]) -> None:
        """After this sink's commit: the version it made, known with the source's mark when the commit knows it
        (at the version of the snapshot it holds plus one: the first attempt, or one made again after losing to
        a rewrite), and the files gauge from that snapshot and the commit's own files, without reading the log
        again."""
        try:
            version = table.table.version()
            if table.committed_version == version + 1:
                version += 1
                self._known[source] = (version, landed)
                new = adds
            else:  # it failed after its commit point and read the log again: the log says where it landed
                self._known.pop(source, None)
                version, new = table.refresh(), []
            if self._checkpointer is not None:
                self._checkpointer.committed(version)
            policy = self.options.file_policy()
            counts, small = _files_per_partition(table, new, policy or FilePolicy())
            self._counts = small if policy is not None else None
            metrics.LAKE_FILES_PER_PARTITION_MAX.set(max(counts.values(), default=0))
            metrics.LAKE_SMALL_FILES_PER_PARTITION_MAX.set(max(small.values(), default=0))
            metrics.LAKE_TABLE_VERSION.set(version)
        except (DeltaError, OSError) as exc:  # landed already: a figure is no reason to send it again
            self._counts = None
            log.warning("lake_files_gauge_not_updated", error=describe(exc))

    def _bound_files(self, table: ChangeTable, adds: Sequence[Any]) -> None:
        """After a commit: queue the partitions it touched for the rewriter's thread (its own Delta handle), which
        rewrites their over-full size tiers while the next batches are read, built, written and committed. The
        batch has landed: a rewrite that fails is logged and tried again after the next commit, never a reason
        to send the batch again."""
        policy = self.options.file_policy()
        if policy is None or not adds:
            return
        if self._rewriter is None:
            self._rewriter = Rewriter(table.path, policy, checkpoints=self._checkpointer is None)
        self._rewriter.submit([dict(add.partition_values) for add in adds])

    def _room_for(self, table: ChangeTable, source: str, read: SourceMark, adds: Sequence[Any]) -> bool:
        """Before a commit to ``changes`` of ``adds``: a commit that would take a partition past
        ``max_files_per_partition`` small files waits for the rewrites of the full partitions first (Paimon's stop
        trigger: delivery then goes no faster than the rewrites, and a partition holds at most the bound at every
        moment); any other commit goes on beside a rewrite still running. After a wait the snapshot is brought
        up to date and the commit goes on at the new version provided the source's mark is still ``read`` (what
        ``ChangeTable.commit`` does after losing to any other writer). False: the mark moved meanwhile (another
        writer landed this source): the caller filters the batch again."""
        policy = self.options.file_policy()
        if policy is None or not adds:
            return True
        rewriter = self._rewriter
        new = Counter(_partition_of(table, add) for add in adds)

        def over(counts: Counter[tuple[Any, ...]]) -> list[Any]:
            return [add for add in adds if counts[part := _partition_of(table, add)] + new[part] > policy.max_files]

        known = self._counts
        full = over(known if known is not None else _small_files(table, policy))
        if full and known is not None and (rewriter is None or not rewriter.in_flight):
            # Counted after the last commit: the snapshot, refreshed for this batch, holds the rewrites since.
            full = over(_small_files(table, policy))
        if not full:
            return True
        if rewriter is None:
            rewriter = self._rewriter = Rewriter(table.path, policy, checkpoints=self._checkpointer is None)
        rewriter.submit([dict(add.partition_values) for add in full])
        waited = rewriter.waited_s
        metrics.LAKE_FILES_BOUND_WAITING.set(1)
        try:
            rewriter.wait()
        finally:
            metrics.LAKE_FILES_BOUND_WAITING.set(0)
            self.rewrite_wait_s += rewriter.waited_s - waited
            metrics.LAKE_FILES_BOUND_WAIT_SECONDS.inc(rewriter.waited_s - waited)
        table.refresh()
        self._counts = None
        return self._mark(table, source) == read

    def _diverged_at(
        self, table: ChangeTable, batch: EventBatch, read: SourceMark, replayed: list[RecordSlice]
    ) -> int | None:
        """Index of the first replayed record that is not what the lake holds at its position (None: all are)."""
        built, _ = build_table(replayed, batch, batch.source_node, False, read.generation)
        mine = _by_record(built)
        landed = _by_record(
            table.landed_rows(batch.source_node, read.generation, replayed[0].pointer, replayed[-1].pointer)
        )
        pointers = sorted(set(mine) | set(landed))
        for ptr in pointers:
            if mine.get(ptr) != landed.get(ptr):
                wp = WalPointer(*ptr)
                return next(i for i, s in enumerate(replayed) if s.pointer >= wp)
        return None

    def _write(
        self, table: ChangeTable, slices: list[RecordSlice], batch: EventBatch, generation: int
    ) -> tuple[WrittenFiles, dict[str, int]]:
        """The batch as Parquet files in the table, not yet committed, in up to ``max_files_per_batch``
        parts (each one file per partition); the rows per cache."""
        parts = split_slices(slices, self.options.max_files_per_batch, min_rows=_MIN_ROWS_PER_FILE)
        if self.options.uses_spark:
            info = BatchInfo(batch.source_node, generation, batch.cache_names)
            written = self._write_on_spark(table, parts, info)
            rows: dict[str, int] = {}
            for add in written.adds:
                cache = str(add.partition_values["cache"])
                rows[cache] = rows.get(cache, 0) + json.loads(add.stats)["numRecords"]
            return written, rows
        return self._write_arrow(table, parts, batch, generation)

    def _probe_fields(self, data: pa.Table) -> None:
        if self._maintainer is None or not self.options.compact_interval_s or not self.options.typed_tables:
            return
        for cache, names in top_level_fields(data).items():
            self._fields_landed.setdefault(cache, set()).update(names)

    def _write_on_spark(self, table: ChangeTable, parts: list[list[RecordSlice]], info: BatchInfo) -> WrittenFiles:
        """One Spark task per part builds its rows and writes them (cdcd/lake/landing/spark_write.py)."""
        try:
            return write_on_executors(self._spark, table, self.location, parts, info, files=self._part_files)
        except Exception as exc:
            rows = sum(s.end - s.start for part in parts for s in part)
            cause = root_cause(exc)
            raise LakeWriteError(
                f"writing {rows} rows to {table.path} failed: {cause}", transient=_io_error(cause)
            ) from None

    def _write_arrow(
        self, table: ChangeTable, parts: list[list[RecordSlice]], batch: EventBatch, generation: int
    ) -> tuple[WrittenFiles, dict[str, int]]:
        """Each part built while the previous one is written: pyarrow's Parquet encoding and
        compression run without the GIL, on the other core."""
        rows: dict[str, int] = {}
        futures: list[Future[WrittenFiles]] = []
        by_day = self.options.partition_by_day
        with ThreadPoolExecutor(1, thread_name_prefix="cdcd-lake-write") as pool:
            try:
                for part in parts:
                    data, part_stats = build_table(part, batch, batch.source_node, by_day, generation)
                    futures.append(pool.submit(table.write_arrow, data))
                    self._probe_fields(data)
                    for name, (n, _ts) in part_stats.items():
                        rows[name] = rows.get(name, 0) + n
                written = [f.result() for f in futures]
            except BaseException:
                for f in futures:  # what did get written is never committed: remove it now
                    if f.done() and f.exception() is None:
                        f.result().discard()
                raise
        return WrittenFiles(table.path, [a for w in written for a in w.adds]), rows


def _partition_of(table: ChangeTable, add: Any) -> tuple[Any, ...]:
    return tuple(add.partition_values.get(c) for c in table.partition_by)


def _small_files(table: ChangeTable, policy: FilePolicy) -> Counter[tuple[Any, ...]]:
    """Files below full size per partition of the snapshot ``table`` holds."""
    return _files_per_partition(table, [], policy)[1]


def _files_per_partition(
    table: ChangeTable, adds: Sequence[Any], policy: FilePolicy
) -> tuple[Counter[tuple[Any, ...]], Counter[tuple[Any, ...]]]:
    """Files per partition of the snapshot ``table`` holds plus ``adds`` (not in it yet): all of them (the files
    gauge), and those below ``policy``'s full size, which the bound counts."""
    snapshot = pa.table(table.table.get_add_actions(flatten=True))
    keys = list(zip(*(snapshot.column(f"partition.{c}").to_pylist() for c in table.partition_by), strict=True))
    counts = Counter(keys)
    counts.update(_partition_of(table, add) for add in adds)
    sizes = snapshot.column("size_bytes").to_pylist()
    small = Counter(k for k, size in zip(keys, sizes, strict=True) if size < policy.large_file_bytes)
    small.update(_partition_of(table, add) for add in adds if add.size < policy.large_file_bytes)
    return counts, small
