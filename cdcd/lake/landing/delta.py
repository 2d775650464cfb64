"""Landing change rows in ``<lake>/changes`` (a Delta table), exactly once, for both writers.

Who commits: always delta-rs (``deltalake``), whichever writer made the Parquet files. Its commit
creates ``_delta_log/<version>.json`` with an atomic put-if-absent (a hard link on a local disk), so
two *processes* committing at once (the node's realtime worker and the daemon around a hand-over)
cannot overwrite each other; Spark's log store for local paths only serialises commits inside one
JVM (a second JVM's rename can replace the first's commit file).

Exactly once: every commit carries a Delta application transaction per source node,
``cdcd:<node id>`` (``:g<n>`` for generation n), whose version encodes the WAL pointer of the last
record the commit landed (``encode_version``). Before writing, the writer reads it back and drops
every record at or below it; commits are made at exactly the table version read plus one
(``max_commit_retries=0``), and a commit that lost the race re-reads the mark: unchanged (another
source or a maintenance commit won) it commits the same files at the next version; changed, its
files are deleted (never named by any commit) and the batch is filtered again. A DataRecord is never
split across commits: the daemon and the realtime worker hand whole records, and the mark names a
record, not an entry, so no reader ever sees half of a node transaction.

Generations: records at or below the mark are checked against the rows the lake holds for them; a
record that differs (a node dir restored from a backup reuses WAL positions) starts generation n+1
of the source, with its own application transaction, landed from that record on.

Durability: data files are fsynced (and their directories) before the commit that names them; files
of a batch that never committed are orphans that ``vacuum`` removes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, PostCommitHookProperties, RemoveAction

from cdcd.durable import fsync_dir, fsync_file, sync_filesystem
from cdcd.lake.landing.parquet_files import parquet_codec, slice_stats, write_parquet
from cdcd.lake.properties import absent_properties, set_absent_properties
from cdcd.lake.reading.check import damaged_table
from cdcd.lake.storage import LakeDir, as_location_arg
from cdcd.lake.table import (
    CHANGES,
    CHANGES_LOG_PROPERTIES,
    CHANGES_PROPERTIES,
    SOURCE_APP_PREFIX,
    change_partitions,
    change_schema,
)
from cdcd.logging import one_line
from cdcd.wal.pointer import WalPointer

log = structlog.get_logger("cdcd.lake")

OFFSET_BITS = 32
"""Application transaction version = ``segment << 32 | offset`` of the last landed record: strictly
increasing with the WAL position, and a non-negative Java long for every segment below 2**31 and
every offset below 4 GiB (a segment longer than that is refused, never mis-ordered)."""
MAX_OFFSET = (1 << OFFSET_BITS) - 1
MAX_SEGMENT = (1 << (63 - OFFSET_BITS)) - 1

_FSYNC_EACH_MAX_FILES = 16
"""Above this many files in one batch, one syncfs of the file system is cheaper than an fsync each."""


class LakeWriteError(RuntimeError):
    """The lake could not take a batch (one line: the path and the root cause). ``transient``: an
    I/O error of the disk or the store (unreachable, full), which waiting may cure."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def encode_version(ptr: WalPointer) -> int:
    if not 0 <= ptr.segment <= MAX_SEGMENT or not 0 <= ptr.offset <= MAX_OFFSET:
        raise LakeWriteError(
            f"WAL pointer {ptr} is beyond what the lake's application transaction version holds "
            f"(segment <= {MAX_SEGMENT}, offset <= {MAX_OFFSET}: keep wal_segment_size_bytes below 4 GiB)"
        )
    return (ptr.segment << OFFSET_BITS) | ptr.offset


def decode_version(version: int) -> WalPointer:
    return WalPointer(version >> OFFSET_BITS, version & MAX_OFFSET)


def app_id(source_node: str, generation: int) -> str:
    return f"{SOURCE_APP_PREFIX}{source_node}" + (f":g{generation}" if generation else "")


def first_app_id(source_node: str, generation: int) -> str:
    """The application transaction whose version is the first record of a generation (n >= 1)."""
    return f"{app_id(source_node, generation)}:first"


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def partition_dir_value(value: str) -> str:
    """The directory form of a partition value: the value itself when it is short and plain, else a
    readable prefix and a hash. Delta keeps the real value in the log, so any name the node accepts
    (255 characters, 200 x "é", "/", "%") lands; readers never parse the directory."""
    if _PLAIN.fullmatch(value):  # not match() with "$": that also accepts a name ending in "\n"
        return value
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", value)[:40].lstrip("._-")
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{prefix}-{digest}" if prefix else f"h-{digest}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return f"{type(exc).__name__}: {one_line(str(exc))}"


_NEARLY_FULL_BYTES = 16 * 1024 * 1024


def _commit_reason(root: LakeDir, exc: BaseException) -> str:
    """``_reason``, naming a full disk: delta-rs reports a failed local write as a "Generic
    LocalFileSystem error" without its errno."""
    reason = _reason(exc)
    if isinstance(root, Path) and not (isinstance(exc, OSError) and exc.errno):
        try:
            st = os.statvfs(root)
        except OSError:
            return reason
        free = st.f_bavail * st.f_frsize
        if free < _NEARLY_FULL_BYTES:
            return f"{reason} ({os.strerror(errno.ENOSPC)}: {free} bytes free)"
    return reason


@dataclass(frozen=True)
class SourceMark:
    """What the lake holds of one source: its generation and the pointer of the last landed record."""

    generation: int
    last: WalPointer | None


@dataclass
class WrittenFiles:
    """Parquet files of one batch under the table, fsynced, not yet named by any commit."""

    root: LakeDir
    adds: list[AddAction]

    def discard(self) -> None:
        for add in self.adds:
            (self.root / add.path).unlink(missing_ok=True)
        self.adds = []


class ChangeTable:
    """``<lake>/changes``: open (creating it once), read source marks, write files, commit."""

    def __init__(self, lake: LakeDir, partition_by_day: bool) -> None:
        self.lake = lake
        self.path = lake / CHANGES
        self.partition_by = change_partitions(partition_by_day)
        self.schema = change_schema(partition_by_day)
        self.data_columns = [f.name for f in self.schema if f.name not in self.partition_by]
        self._dt: DeltaTable | None = None
        self._generations: dict[str, int] = {}
        self.commits = 0
        self.committed_version: int | None = None
        """The version the last successful ``commit`` made, when known without reading the log (None: it
        failed after its commit point and found it landed)."""
        self.conflicts = 0
        self.inline_checkpoints = True
        """Whether a commit writes the checkpoint it makes due (delta-rs's post-commit hook); off where a
        ``Checkpointer`` writes them in a thread of its own (cdcd/lake/landing/checkpointer.py)."""

    # --- opening ----------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the table, creating it if there is none."""
        uri, options = as_location_arg(self.path)
        if not DeltaTable.is_deltatable(uri, storage_options=options):
            self.path.mkdir(parents=True, exist_ok=True)
            try:
                DeltaTable.create(
                    uri,
                    self.schema,
                    mode="error",
                    partition_by=self.partition_by,
                    name="cdcd_changes",
                    description="cdcd change data: one row per WAL data entry",
                    configuration=CHANGES_PROPERTIES,
                    storage_options=options,
                )
            except (DeltaError, OSError) as exc:
                if not DeltaTable.is_deltatable(
                    uri, storage_options=options
                ):  # not another writer creating it at the same moment
                    raise LakeWriteError(f"lake {self.path}: cannot create the changes table: {_reason(exc)}") from None
        try:
            dt = DeltaTable(uri, storage_options=options)
            parts = dt.metadata().partition_columns
        except (DeltaError, OSError) as exc:  # delta-rs names no file: the check finds it
            reason = f"lake {self.path}: cannot open the changes table: {_reason(exc)}"
            raise damaged_table(self.path) or LakeWriteError(reason) from None
        if list(parts) != self.partition_by:
            raise LakeWriteError(
                f"lake {self.path}: the changes table is partitioned by {list(parts)}, this sink by "
                f"{self.partition_by} (partition_by_day must match the table)"
            )
        retention = dt.metadata().configuration.get("delta.setTransactionRetentionDuration")
        if retention:
            raise LakeWriteError(
                f"lake {self.path}: delta.setTransactionRetentionDuration = {retention} would let the "
                "per-source application transactions expire (exactly once depends on them): unset it"
            )
        have = {f.name for f in dt.schema().fields}
        missing = [n for n in self.schema.names if n not in have]
        if missing:
            raise LakeWriteError(f"lake {self.path}: the changes table has no column(s) {missing}")
        self._dt = dt
        self._set_log_properties()

    def _set_log_properties(self) -> None:
        """``CHANGES_LOG_PROPERTIES`` on a table created before them (one metadata commit, once; a neighbour
        setting them at the same moment wins and this one finds them set)."""
        try:
            absent = set_absent_properties(self.table, CHANGES_LOG_PROPERTIES)
        except (DeltaError, OSError) as exc:
            wanted = sorted(absent_properties(self.table, CHANGES_LOG_PROPERTIES))
            raise LakeWriteError(f"lake {self.path}: cannot set {wanted}: {_reason(exc)}") from None
        if absent:
            log.info("lake_changes_log_properties_set", path=str(self.path), properties=absent)

    @property
    def table(self) -> DeltaTable:
        if self._dt is None:
            raise RuntimeError("ChangeTable used before open()")
        return self._dt

    def refresh(self) -> int:
        dt = self.table
        dt.update_incremental()
        return dt.version()

    def mark(self, source: str) -> SourceMark:
        """The source's newest generation and its last landed record (of the snapshot last refreshed)."""
        dt = self.table
        gen = self._generations.get(source, 0)
        version = dt.transaction_version(app_id(source, gen))
        while True:
            newer = dt.transaction_version(app_id(source, gen + 1))
            if newer is None:
                break
            gen, version = gen + 1, newer
        self._generations[source] = gen
        return SourceMark(gen, None if version is None else decode_version(version))

    # --- writing files ----------------------------------------------------------------------------
    def _dir_of(self, values: Sequence[str]) -> Path:
        return Path(*(f"{c}={partition_dir_value(v)}" for c, v in zip(self.partition_by, values, strict=True)))

    def write_arrow(self, table: pa.Table, max_rows_per_file: int = 1 << 20) -> WrittenFiles:
        """``table`` as Parquet files, one or more per partition, durable before this returns: each
        fsynced with its directory, or, when a batch spans many partitions (many caches), one
        ``syncfs`` of the table's file system instead of an fsync per file."""
        out = WrittenFiles(self.path, [])
        group = np.zeros(table.num_rows, np.int64)
        for c in self.partition_by:
            codes = table.column(c).combine_chunks().dictionary_encode()
            group = group * len(codes.dictionary) + codes.indices.to_numpy(zero_copy_only=False)
        # One stable sort and one take instead of a scan of every row per partition: rows of a group
        # stay in WAL order, each file is a slice of the sorted table.
        order = np.argsort(group, kind="stable")
        data = table.select(self.data_columns)
        if table.num_rows and np.any(order[1:] < order[:-1]):
            data = data.take(pa.array(order))
        bounds = np.flatnonzero(np.diff(group[order])) + 1
        starts = np.concatenate([[0], bounds]).astype(np.int64) if table.num_rows else np.zeros(0, np.int64)
        ends = np.append(starts[1:], table.num_rows)
        firsts = pa.array(order[starts])
        values_of = [table.column(c).take(firsts).to_pylist() for c in self.partition_by]
        slices: list[tuple[int, int]] = []
        tasks: list[tuple[Path, pa.Table, list[str]]] = []
        for i, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
            values = [str(v[i]) for v in values_of]
            rel_dir = self._dir_of(values)
            for start in range(lo, hi, max_rows_per_file):
                end = min(hi, start + max_rows_per_file)
                slices.append((start, end))
                tasks.append((rel_dir, data.slice(start, end - start), values))
        stats = slice_stats(data, slices)
        local = isinstance(self.path, Path)
        per_file_fsync = local and len(tasks) <= _FSYNC_EACH_MAX_FILES

        def write(index: int) -> None:
            rel_dir, chunk, values = tasks[index]
            (self.path / rel_dir).mkdir(parents=True, exist_ok=True)
            rel = rel_dir / f"part-{uuid.uuid4().hex}.c000.{parquet_codec(chunk)}.parquet"
            size, mtime_ms = write_parquet(chunk, self.path / rel, fsync=per_file_fsync)
            pv = dict(zip(self.partition_by, values, strict=True))
            # list.append is atomic: a failed batch still knows every file it must discard.
            out.adds.append(AddAction(rel.as_posix(), size, pv, mtime_ms, True, stats[index]))

        try:
            if len(tasks) > 1:
                # pyarrow encodes and writes without the GIL: two threads keep both cores busy.
                with ThreadPoolExecutor(max_workers=2, thread_name_prefix="cdcd-lake-write") as pool:
                    for _ in pool.map(write, range(len(tasks))):
                        pass
            else:
                for index in range(len(tasks)):
                    write(index)
            root = self.path
            synced = isinstance(root, Path) and not per_file_fsync and sync_filesystem(root)
            if not synced:
                if isinstance(root, Path) and not per_file_fsync:
                    for add in out.adds:
                        fsync_file(root / add.path)
                self._fsync_dirs({self.path / rel_dir for rel_dir, _, _ in tasks})
        except OSError as exc:
            out.discard()
            raise LakeWriteError(
                f"lake {self.path}: writing {table.num_rows} rows failed: {_reason(exc)}", transient=True
            ) from None
        return out

    def _fsync_dirs(self, dirs: Iterable[LakeDir]) -> None:
        if not isinstance(self.path, Path):
            return  # an object is durable once its PUT returned; a store has no directories
        parents: set[Path] = set()
        for d in dirs:
            assert isinstance(d, Path)
            fsync_dir(d)
            parents.update(p for p in d.parents if p == self.path or self.path in p.parents)
        for p in parents:
            fsync_dir(p)

    # --- committing -------------------------------------------------------------------------------
    def commit(
        self,
        files: WrittenFiles,
        *,
        source: str,
        read: SourceMark,
        generation: int,
        last: WalPointer,
        first: WalPointer,
        metadata: Mapping[str, Any],
    ) -> bool:
        """Commit ``files`` with the source's mark moved to ``last`` in ``generation``, provided the
        mark is still ``read`` (what the batch was filtered against).

        True: committed. False: another commit moved this source's mark since it was read; the
        files are deleted and the caller filters the batch again."""
        version = encode_version(last)
        now_ms = int(time.time() * 1000)
        txns = [Transaction(app_id(source, generation), version, now_ms)]
        if generation != read.generation:  # where the new generation's history starts
            txns.append(Transaction(first_app_id(source, generation), encode_version(first), now_ms))
        attempt = uuid.uuid4().hex  # tells this commit from another writer's of the same records
        info = {"source": source, "generation": generation, "last": str(last), "attempt": attempt, **metadata}
        props = CommitProperties(
            max_commit_retries=0, app_transactions=txns, custom_metadata={"cdcd": json.dumps(info)}
        )
        dt = self.table
        actions: list[AddAction | RemoveAction] = list(files.adds)
        hooks = PostCommitHookProperties(create_checkpoint=self.inline_checkpoints, cleanup_expired_logs=False)
        while True:
            read_version = dt.version()
            try:
                dt.create_write_transaction(
                    actions,
                    "append",
                    self.schema,
                    partition_by=self.partition_by,
                    commit_properties=props,
                    post_commithook_properties=hooks,
                )
                self.commits += 1
                self.committed_version = read_version + 1  # max_commit_retries=0: exactly the next version
                return True
            except (DeltaError, OSError) as exc:
                error = exc
            # Where did the commit end? Read the log again (an error while doing so keeps the files:
            # they may be committed; if not, they are orphans vacuum removes).
            try:
                now = self.refresh()
                mark = self.mark(source)
                ours = mark == SourceMark(generation, last) and self._committed(attempt, read_version, now)
            except (DeltaError, OSError) as exc:
                reason = f"lake {self.path}: commit failed: {_commit_reason(self.path, error)}; then: {_reason(exc)}"
                raise damaged_table(self.path) or LakeWriteError(reason, transient=isinstance(exc, OSError)) from None
            if ours:  # landed, failing after its commit point (a checkpoint)
                log.warning("lake_commit_error_after_landing", error=_reason(error), version=now)
                self.commits += 1
                self.committed_version = None
                return True
            if now == read_version or not isinstance(error, CommitFailedError):
                files.discard()
                raise LakeWriteError(
                    f"lake {self.path}: commit failed: {_commit_reason(self.path, error)}",
                    transient=isinstance(error, OSError),
                ) from None
            self.conflicts += 1
            if mark != read:
                files.discard()
                return False
            log.debug("lake_commit_retry", source=source, version=now)

    def _committed(self, attempt: str, read_version: int, now: int) -> bool:
        """Whether a version after ``read_version`` is the commit of ``attempt`` (not another writer's that
        moved the mark to the same record: its files are not ours, and counting it would count it twice)."""
        for entry in self.table.history(max(1, now - read_version)):
            if (
                entry.get("version", -1) > read_version
                and json.loads(entry.get("cdcd", "{}")).get("attempt") == attempt
            ):
                return True
        return False

    def files_per_partition_max(self) -> int:
        """Most data files in one partition of the snapshot last refreshed or committed (0: none). The
        snapshot holds every add action already: a group-by in memory, no listing of the store."""
        adds = pa.table(self.table.get_add_actions(flatten=True))
        if not adds.num_rows:
            return 0
        keys = [f"partition.{c}" for c in self.partition_by]
        counts = adds.group_by(keys).aggregate([([], "count_all")]).column("count_all")
        return int(pc.max(counts).as_py())

    # --- what landed ------------------------------------------------------------------------------
    def landed_rows(self, source: str, generation: int, lo: WalPointer, hi: WalPointer) -> pa.Table:
        """The rows of ``source`` with pointers in ``lo..hi`` (inclusive), each position's rows of the
        history that holds it now: the newest generation up to ``generation`` that started at or
        before it (a generation's history replaces the older ones from its first record on)."""
        dt = self.table
        starts = [(0, 0)]
        for g in range(1, generation + 1):
            first = dt.transaction_version(first_app_id(source, g))
            if first is not None:
                starts.append((g, first))
        ds = dt.to_pyarrow_dataset()
        # Only columns with statistics in the dataset filter: delta-rs's fragments claim "x >= null"
        # for a column without bounds, which would skip every file for a filter on it.
        f = (
            (pc.field("source_generation") <= generation)
            & (pc.field("wal_segment") >= lo.segment)
            & (pc.field("wal_segment") <= hi.segment)
        )
        cols = ["wal_segment", "wal_offset", "wal_index", "op", "key", "value", "source_node", "source_generation"]
        rows = ds.to_table(columns=cols, filter=f)
        rows = rows.filter(pc.equal(rows.column("source_node"), source))
        rows = rows.filter(pc.not_equal(rows.column("op"), "truncate"))  # a drop, not an entry of a record
        key = pc.add(pc.multiply(rows.column("wal_segment"), 1 << OFFSET_BITS), rows.column("wal_offset"))
        keep = pc.and_(pc.greater_equal(key, encode_version(lo)), pc.less_equal(key, encode_version(hi)))
        rows = rows.append_column("_ptr", key).filter(keep)
        if len(starts) == 1:
            return rows.filter(pc.equal(rows.column("source_generation"), 0))
        ptrs = rows.column("_ptr").to_numpy(zero_copy_only=False)
        holder = np.zeros(len(ptrs), np.int64)
        for g, first in starts:
            holder = np.where(ptrs >= first, np.maximum(holder, g), holder)
        gens = rows.column("source_generation").to_numpy(zero_copy_only=False)
        return rows.filter(pa.array(gens == holder))
