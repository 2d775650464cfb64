"""Small files bounded at every moment: compaction of the partitions a commit just touched, without a JVM.

Delta's auto compaction and Paimon's sorted-run bound solve small files by construction, not by a
timer: right after a write, the writer itself compacts the partitions it touched once they hold too
many small files. This is that, for cdcd's tables (``changes`` after each of the sink's commits,
``state`` and every typed table after each compaction):

- **Size tiers** (size-tiered compaction, as LSM stores and Paimon's universal compaction do): a
  partition's files below ``large_file_bytes`` fall into tiers ``[0, base)``, ``[base, base*f)``,
  ``[base*f, base*f^2)`` ... A tier holding more files than it is allowed is rewritten as one file,
  which lands in the same or the next tier. Each run reads a tier's few files, so its cost grows with
  the new small files, not with the partition: no re-packing of a 64 MiB bin per commit; a byte is
  rewritten about once per tier over its life (``log_f(large/base)`` times).
- **The bound**: the tiers' allowances add up to ``max_files - 1``, so with the commit that pushes a
  tier over, a partition holds at most ``max_files`` files below ``large_file_bytes`` at every moment
  (files of ``large_file_bytes`` or more are full-size: never rewritten, about one per GiB landed).
- **Beside the commits, off the delivery path** (``Rewriter``): the rewrites the commits make due run
  in a thread of their own (its own ``DeltaTable``), one at a time, while the writer goes on reading,
  building, writing and committing; a commit waits only when it would take a partition past the bound
  (Paimon's stop trigger), so when compaction is slow the writer's commits slow down (back-pressure),
  never past the file count. Once one queued partition is due, those one file short of due are rewritten
  in the same commit (``along``): they fill in step. Memory: one group of files.
- **Exactly once**: the rewrite is one commit of ``remove`` and ``add`` actions with ``dataChange =
  false`` (what Delta's OPTIMIZE writes: readers, the change data feed and cdcd's compaction,
  ``feed.read_feed`` and ``deltalog.data_changing_versions``, see the same rows), each attempt made at
  exactly the version read plus one (``max_commit_retries = 0``, delta-rs's put-if-absent). Losing the
  race, it is made again at the newest version only if every file it removes is still live there (the
  commits between only added files: ``rebases``); otherwise it deletes its new file and the next commit
  tries again. It carries no application transaction and moves none: every source's mark and
  ``cdcd-compact`` stay as they are. Killed before its commit, the new file is an orphan (vacuum removes
  it); after, it is done.
- **Any name**: the new file goes into the directory of a file it replaces, so it follows each
  table's rule (``cache=<dir>`` of ``changes``, the random prefixes of ``state``) whatever the cache
  name; delta-rs's own ``optimize.compact`` writes ``cache=<escaped name>`` and fails on 255-char
  names.
- **Sorted runs** (``state`` and the typed tables, after each compaction): their files are key-range
  clustered (cdcd/lake/maintenance/clustered.py), pairwise disjoint by key, so a partition's longest such
  run counts as one file (Paimon's sorted run) and is never packed back into one file; the tiers bound the
  other files of a ``state`` partition, and a typed table with more runs than the bound allows is merged
  into one sorted run again (every column's statistics kept: ``lake show`` counts rescued rows from them).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
import structlog
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, PostCommitHookProperties, RemoveAction

from cdcd import failpoints, metrics
from cdcd.durable import fsync_dir, fsync_file
from cdcd.lake.landing.parquet_files import file_stats
from cdcd.lake.maintenance.clustered import FILE_ROWS, ranged_files, recluster, sorted_runs
from cdcd.lake.storage import LakeDir, file_source, is_delta, open_delta
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")

WRITTEN = "lake.autocompact.written"
"""Fail point: the merged files are written and fsynced, not yet committed."""
COMMITTED = "lake.autocompact.committed"
"""Fail point: the rewrite is committed."""

COMMIT_TAG = "autocompact"
"""``commitInfo.cdcd`` of a rewrite: ``{"autocompact": {"files_removed": n, "files_added": m}}``."""


@dataclass(frozen=True)
class FilePolicy:
    """How many files a partition may hold and how they are grouped (see the module doc)."""

    max_files: int = 20
    """Files below ``large_file_bytes`` per partition, at most, at every moment."""
    base_bytes: int = 256 << 10
    """Upper bound of the smallest tier (live traffic's files are tens of KiB)."""
    factor: int = 4
    """Each tier's bound is this many times the one below."""
    large_file_bytes: int = 64 << 20
    """Files this large are full-size: never rewritten (as the scheduled Spark OPTIMIZE left them). A
    rewrite holds its group in memory: at most the top tier's allowance plus one files below this."""
    file_rows: int = FILE_ROWS
    """Rows per key-range clustered file of ``state`` and the typed tables (``compact_file_rows``,
    cdcd/lake/maintenance/clustered.py): their files sorted by key, pairwise disjoint, count as one sorted
    run toward ``max_files``."""

    def __post_init__(self) -> None:
        if self.max_files < self.tiers + 1:
            raise ValueError(
                f"max_files_per_partition = {self.max_files}: must be at least {self.tiers + 1} (one file per "
                f"size tier and the one a commit adds)"
            )
        if self.factor < 2 or self.base_bytes < 1 or self.large_file_bytes <= self.base_bytes:
            raise ValueError("file tiers: factor >= 2 and 0 < base_bytes < large_file_bytes")
        if self.file_rows < 1:
            raise ValueError(f"compact_file_rows = {self.file_rows}: must be at least 1")

    @property
    def bounds(self) -> list[int]:
        """Upper bounds of the tiers, the last one ``large_file_bytes``."""
        out = [self.base_bytes]
        while out[-1] * self.factor < self.large_file_bytes:
            out.append(out[-1] * self.factor)
        return [*out, self.large_file_bytes]

    @property
    def tiers(self) -> int:
        return len(self.bounds)

    def allowance(self, tier: int) -> int:
        """Files tier ``tier`` keeps before it is rewritten: ``max_files - 1`` spread over the tiers, the
        smallest (where every commit lands) taking what is left over, so it is rewritten least often."""
        each = (self.max_files - 1) // self.tiers
        return each if tier else self.max_files - 1 - each * (self.tiers - 1)

    def tier_of(self, size: int) -> int | None:
        """The tier of a file of ``size`` bytes (None: full-size)."""
        for tier, bound in enumerate(self.bounds):
            if size < bound:
                return tier
        return None

    def plan(self, files: Sequence[tuple[str, int]], *, early: bool = False) -> list[list[tuple[str, int]]]:
        """Groups of ``(path, size)`` to rewrite, one new file each, so that no tier holds more than its
        allowance afterwards: the smallest over-full tier first, all of its files in one group, whose
        output is counted in the tier it lands in (where it may make that tier over-full: then the two
        rewrites are one group). ``early``: the smallest tier counts as over-full one file sooner (a
        partition whose next commit would make it due, rewritten along with one that is due)."""
        tiers: dict[int, list[tuple[str, int]]] = {}
        for path, size in files:
            tier = self.tier_of(size)
            if tier is not None:
                tiers.setdefault(tier, []).append((path, size))
        groups: list[list[tuple[str, int]]] = []
        carried: dict[int, list[tuple[str, int]]] = {}
        """tier -> a planned group whose output lands there (not yet in ``groups``)."""
        for tier in range(self.tiers):
            members = tiers.get(tier, [])
            inbound = carried.pop(tier, None)
            count = len(members) + (1 if inbound is not None else 0)
            if count <= self.allowance(tier) - (1 if early and tier == 0 else 0):
                if inbound is not None:
                    groups.append(inbound)
                continue
            group = (inbound or []) + sorted(members, key=lambda f: f[1])
            landed = self.tier_of(sum(size for _, size in group))
            if landed is not None and landed > tier:
                carried[landed] = group
            else:
                groups.append(group)
        groups.extend(carried.values())
        return [g for g in groups if len(g) >= 2]


@dataclass(frozen=True)
class Rewritten:
    """One table's rewrite: files removed, files added, partitions touched, seconds."""

    removed: int
    added: int
    partitions: int
    seconds: float
    version: int = -1
    """The version the rewrite committed (-1: not known)."""


def _partition_files(dt: DeltaTable, partition_by: Sequence[str]) -> dict[tuple[str | None, ...], list[Any]]:
    """Per partition (values in ``partition_by`` order), its live files: ``(path, size, partition values)``."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    out: dict[tuple[str | None, ...], list[Any]] = {}
    if not adds.num_rows:
        return out
    paths = adds.column("path").to_pylist()
    sizes = adds.column("size_bytes").to_pylist()
    values = [adds.column(f"partition.{c}").to_pylist() for c in partition_by]
    for i, (path, size) in enumerate(zip(paths, sizes, strict=True)):
        key = tuple(v[i] for v in values)
        out.setdefault(key, []).append((path, int(size), dict(zip(partition_by, key, strict=True))))
    return out


def _outside_main_run(
    dt: DeltaTable, by_partition: dict[tuple[str | None, ...], list[Any]], key: str, policy: FilePolicy
) -> dict[tuple[str | None, ...], list[Any]]:
    """Per partition, its files but those of its longest sorted run by ``key`` (below full size)."""
    ranged = {f.path: f for f in ranged_files(pa.table(dt.get_add_actions(flatten=True)), key)}
    out: dict[tuple[str | None, ...], list[Any]] = {}
    for part, files in by_partition.items():
        small = [ranged[p] for p, size, _ in files if size < policy.large_file_bytes and p in ranged]
        runs = sorted_runs(small)
        main = {f.path for f in max(runs, key=len)} if runs else set()
        out[part] = [f for f in files if f[0] not in main]
    return {k: v for k, v in out.items() if v}


def sorted_runs_per_partition(table: LakeDir, key: str) -> dict[tuple[str | None, ...], int]:
    """Sorted runs by ``key`` (files below full size, cdcd/lake/maintenance/clustered.py) per partition of the
    Delta table at ``table``: what the bound counts for ``state`` and the typed tables ({} without a table)."""
    if not is_delta(table):
        return {}
    dt = open_delta(table)
    columns = list(dt.metadata().partition_columns)
    adds = pa.table(dt.get_add_actions(flatten=True))
    if not adds.num_rows:
        return {}
    out: dict[tuple[str | None, ...], int] = {}
    parts = [adds.column(f"partition.{c}").to_pylist() for c in columns]
    groups: dict[tuple[str | None, ...], list[int]] = {}
    for i in range(adds.num_rows):
        groups.setdefault(tuple(v[i] for v in parts), []).append(i)
    for part, rows in groups.items():
        out[part] = len(sorted_runs(ranged_files(adds.take(rows), key)))
    return out


def files_per_partition(table: LakeDir, partition_by: Sequence[str] | None = None) -> dict[tuple[str | None, ...], int]:
    """Live data files per partition of the Delta table at ``table`` (from its log; {} without a table);
    ``partition_by``: the columns to group by (None: the table's partition columns)."""
    if not is_delta(table):
        return {}
    dt = open_delta(table)
    columns = list(dt.metadata().partition_columns) if partition_by is None else partition_by
    return {k: len(v) for k, v in _partition_files(dt, columns).items()}


def _schema(dt: DeltaTable, partition_by: Sequence[str]) -> pa.Schema:
    full = pa.schema(dt.schema().to_arrow())
    return pa.schema([f for f in full if f.name not in partition_by])


def _read(root: LakeDir, path: str, schema: pa.Schema) -> pa.Table:
    pf = pq.ParquetFile(file_source(root / unquote(path)))
    have = set(pf.schema_arrow.names)
    data = pf.read(columns=[n for n in schema.names if n in have])
    for name in schema.names:
        if name not in have:  # a column the table got later: null in older files
            data = data.append_column(schema.field(name), pa.nulls(data.num_rows, schema.field(name).type))
    return data.select(schema.names).cast(schema)


def _merged_stats(parts: Sequence[dict[str, Any]]) -> str:
    """The statistics of the files' rows together: bounds of the columns every part has bounds for."""
    common = set.intersection(*(set(p["minValues"]) & set(p["maxValues"]) for p in parts)) if parts else set()
    mins = {c: min(p["minValues"][c] for p in parts) for c in sorted(common)}
    maxs = {c: max(p["maxValues"][c] for p in parts) for c in sorted(common)}
    nulls = {c: sum(int(p["nullCount"].get(c, 0)) for p in parts) for c in sorted(common)}
    total = sum(int(p["numRecords"]) for p in parts)
    return json.dumps({"numRecords": total, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def _write_merged(root: LakeDir, rel: str, group: Sequence[tuple[str, int]], schema: pa.Schema) -> tuple[int, str]:
    """The group's rows as one Parquet file at ``root/rel``, fsynced; its size and statistics. (Streaming
    them through a ``ParquetWriter`` instead made a process exit abort now and then: "terminate called
    without an active exception".)"""
    target = root / rel
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        sink: Any = str(target)
        filesystem = None
    else:
        sink, filesystem = target.fs_path, target.fs
    tables = [_read(root, path, schema) for path, _ in group]
    stats = [json.loads(file_stats(t)) for t in tables]
    data = pa.concat_tables(tables)
    if isinstance(target, Path):
        pq.write_table(data, sink, compression="zstd", row_group_size=1 << 20)
        fsync_file(target)
        return target.stat().st_size, _merged_stats(stats)
    pq.write_table(data, sink, filesystem=filesystem, compression="zstd", row_group_size=1 << 20)
    return int(target.size()), _merged_stats(stats)


def rewrite_partitions(
    dt: DeltaTable,
    root: LakeDir,
    policy: FilePolicy,
    *,
    only: Iterable[Mapping[str, str | None]] | None = None,
    runs_by: str | None = None,
    checkpoint: bool = True,
    rebases: int = 0,
    along: bool = False,
) -> Rewritten | None:
    """Rewrite the over-full tiers of the partitions ``only`` names (every partition: None) of the table
    ``dt`` at ``root`` (partitioned as its metadata says: ``cache``, and ``day`` with ``partition_by_day``),
    in one commit at the version ``dt`` holds plus one. None: nothing to do, or the commit lost to another
    writer's (its files deleted; the next call tries again). ``dt`` stays at the version it held: bringing it
    to the new one replays the log since the last checkpoint, which whoever uses it next does anyway.
    ``runs_by``: a key column the table's files are clustered by (``state``'s ``key``): a partition's
    longest sorted run of key-disjoint files counts as one and is left as it is; the tiers bound the
    other files (cdcd/lake/maintenance/clustered.py). ``rebases``: how many times a commit that lost to
    others' commits which left every file it removes in place (appends) is made again at the newest version
    instead of lost. ``along``: once one partition is due, the others whose smallest tier is one file short of
    due are rewritten in the same commit (``FilePolicy.plan``'s ``early``)."""
    started = time.monotonic()
    partition_by = list(dt.metadata().partition_columns)
    by_partition = _partition_files(dt, partition_by)
    if runs_by is not None:
        by_partition = _outside_main_run(dt, by_partition, runs_by, policy)
    if only is not None:
        wanted = {tuple(p.get(c) for c in partition_by) for p in only}
        by_partition = {k: v for k, v in by_partition.items() if k in wanted}
    plans = {part: policy.plan([(p, s) for p, s, _ in files]) for part, files in by_partition.items()}
    if along and any(plans.values()):
        # Partitions a commit touches fill their smallest tier in step: one due soon is rewritten in this
        # commit rather than in one of its own a commit later.
        for part, files in by_partition.items():
            if not plans[part]:
                plans[part] = policy.plan([(p, s) for p, s, _ in files], early=True)
    work = [(files[0][2], group) for part, files in by_partition.items() for group in plans[part]]
    if not work:
        return None
    schema = _schema(dt, partition_by)
    read_version = dt.version()
    attempt = uuid.uuid4().hex
    now_ms = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = []
    written: list[LakeDir] = []
    dirs: set[Path] = set()
    removed = sum(len(group) for _, group in work)
    try:
        for values, group in work:
            largest = max(group, key=lambda f: f[1])[0]
            rel_dir = unquote(largest).rpartition("/")[0]
            name = f"part-{uuid.uuid4().hex}.c000.zstd.parquet"
            rel = f"{rel_dir}/{name}" if rel_dir else name
            target = root / rel
            written.append(target)
            if isinstance(target, Path):
                dirs.add(target.parent)
            size, stats = _write_merged(root, rel, group, schema)
            actions.append(AddAction(rel, size, dict(values), now_ms, False, stats))
            actions.extend(RemoveAction(path, False, now_ms, size_, dict(values)) for path, size_ in group)
        for d in dirs:
            fsync_dir(d)
        failpoints.hit(WRITTEN)
        info = {COMMIT_TAG: {"files_removed": removed, "files_added": len(work), "attempt": attempt}}
        hooks = PostCommitHookProperties(create_checkpoint=checkpoint, cleanup_expired_logs=False)
        gone = {path for _, group in work for path, _ in group}
        while True:
            try:
                dt.create_write_transaction(
                    actions,
                    "append",
                    dt.schema(),
                    partition_by=list(partition_by) or None,
                    commit_properties=CommitProperties(
                        max_commit_retries=0, custom_metadata={"cdcd": json.dumps(info)}
                    ),
                    post_commithook_properties=hooks,
                )
                break
            except (DeltaError, OSError) as exc:
                if _committed(dt, attempt, read_version):
                    # Failed after its commit point (writing the checkpoint): the rewrite is in the table.
                    log.warning("lake_autocompact_error_after_commit", table=str(root), error=describe(exc))
                    break
                if rebases and isinstance(exc, CommitFailedError) and _all_live(dt, gone):
                    rebases -= 1  # others only added files meanwhile: the same rewrite, at the newest version
                    read_version = dt.version()
                    continue
                for target in written:
                    target.unlink(missing_ok=True)
                log.info("lake_autocompact_lost", table=str(root), error=describe(exc))
                return None
    except BaseException:
        if not _committed(dt, attempt, read_version):
            for target in written:
                target.unlink(missing_ok=True)
        raise
    failpoints.hit(COMMITTED)
    partitions = len({tuple(v.items()) for v, _ in work})
    # max_commit_retries=0: committed at exactly the version read (or rebased onto) plus one, or not at all.
    done = Rewritten(removed, len(work), partitions, time.monotonic() - started, read_version + 1)
    log.debug("lake_autocompacted", table=str(root), removed=done.removed, added=done.added, seconds=done.seconds)
    return done


def _all_live(dt: DeltaTable, paths: set[str]) -> bool:
    """Whether every file of ``paths`` is still in the snapshot ``dt`` holds (refreshed by ``_committed``):
    then the commits that came first only added files, and a rewrite of these is still one of the same rows.
    delta-rs's own conflict check does not see two commits removing the same file (``append`` mode)."""
    live = set(pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist())
    return paths <= live


WAIT_LOGGED_S = 1.0
"""A commit that waited this long or longer for the rewrite before it is logged (``lake_autocompact_waited``)."""


REBASES = 8
"""How many times the writer's rewrite is made again at the newest version when commits (the writer's next
batches) came first without touching its files, before it is lost and tried again with the next commit's."""


MADE_KEPT = 16
"""How many of the rewrites' latest versions a ``Rewriter`` remembers (``made``)."""


class Rewriter:
    """The writer's rewrites (``rewrite_partitions`` of the partitions its commits touched) in a thread of its
    own, on a ``DeltaTable`` of its own, beside the writer's commits: ``submit`` after a commit queues the
    partitions it touched, and the thread rewrites what is queued, one rewrite at a time, until nothing is.

    The writer does not wait for it (Paimon's compaction beside its writers): a rewrite only removes files and
    adds their rows back, so the writer's commits meanwhile (appends) leave it valid, and it is made again on
    top of them (``rebases``); the writer's own commit, losing to a rewrite, is made again by
    ``ChangeTable.commit`` (the rewrite moves no source's mark). The writer waits (``wait``) only where a
    commit would take a partition past the bound while a rewrite runs (back-pressure: delivery then goes no
    faster than the rewrites), and at its close. A rewrite that fails is logged (``lake_autocompact_failed``)
    and its partitions are tried again with the next commit's. Killed while one runs, the process leaves
    orphan files only (the merged file, the next batch's files): neither is in the log."""

    def __init__(self, table: LakeDir, policy: FilePolicy, *, checkpoints: bool = True) -> None:
        self.table = table
        self.policy = policy
        self.checkpoints = checkpoints
        """Whether a rewrite's commit writes the checkpoint it makes due (off beside a ``Checkpointer``)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cdcd-lake-autocompact")
        self._dt: DeltaTable | None = None
        """The rewriting thread's handle (only that thread uses it once opened)."""
        self._running: Future[None] | None = None
        """The thread's run over the queue (None: idle; set and cleared under ``_lock``)."""
        self._queued: dict[tuple[tuple[str, str | None], ...], dict[str, str | None]] = {}
        self._failed: list[dict[str, str | None]] = []
        """Partitions of a rewrite that failed: rewritten with the next commit's."""
        self._lock = threading.Lock()
        self.waited_s = 0.0
        """Seconds commits waited for a rewrite so far (the back-pressure of the bound)."""
        self._made: deque[int] = deque(maxlen=MADE_KEPT)
        """The versions the latest rewrites committed."""

    @property
    def in_flight(self) -> bool:
        """A rewrite is running or queued: the table may get a version the writer has not read."""
        with self._lock:
            return self._running is not None

    def made(self, first: int, last: int) -> bool:
        """Whether the rewrites made every version from ``first`` to ``last``: a writer that knows its marks at
        ``first - 1`` knows them at ``last`` without reading the log (a rewrite moves no mark)."""
        with self._lock:
            return set(range(first, last + 1)) <= set(self._made)

    def submit(self, touched: Sequence[Mapping[str, str | None]]) -> None:
        """Queue the over-full tiers of ``touched`` partitions for rewriting (and start the thread if idle)."""
        with self._lock:
            for p in [*self._failed, *touched]:
                self._queued[tuple(sorted(p.items()))] = dict(p)
            self._failed = []
            if self._running is not None or not self._queued:
                return
            self._running = self._pool.submit(self._drain)

    def wait(self) -> bool:
        """Block until the queue is rewritten (each rewrite committed, found nothing to do, lost or failed and
        logged). Whether anything was in flight. Only the submitting thread calls it: nothing is queued
        meanwhile."""
        with self._lock:
            running = self._running
        if running is None:
            return False
        started = time.monotonic()
        running.result()  # _rewrite logs and keeps what fails; anything else it raises is a bug: raise it here
        waited = time.monotonic() - started
        self.waited_s += waited
        if waited >= WAIT_LOGGED_S:
            log.info("lake_autocompact_waited", table=str(self.table), seconds=round(waited, 3))
        return True

    def close(self) -> None:
        """Wait for the queue to be rewritten, then end the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    partitions = list(self._queued.values())
                    self._queued.clear()
                    if not partitions:
                        self._running = None
                        return
                self._rewrite(partitions)
        except BaseException:
            with self._lock:
                self._running = None
            raise

    def _rewrite(self, partitions: list[dict[str, str | None]]) -> None:
        started = time.monotonic()
        try:
            if self._dt is None:
                self._dt = open_delta(self.table)
            else:
                self._dt.update_incremental()  # the commits that queued these partitions
            done = rewrite_partitions(
                self._dt,
                self.table,
                self.policy,
                only=partitions,
                checkpoint=self.checkpoints,
                rebases=REBASES,
                along=True,
            )
        except Exception as exc:  # the batch landed already: its partitions are tried again with the next commit's
            self._dt = None  # opened afresh next time, whatever state the failure left it in
            with self._lock:
                self._failed.extend(partitions)
            log.warning("lake_autocompact_failed", table=str(self.table), error=describe(exc))
            return
        if done is not None:
            with self._lock:
                self._made.append(done.version)
            seconds = time.monotonic() - started
            metrics.LAKE_MAINTENANCE_SECONDS.labels("autocompact").observe(seconds)
            metrics.LAKE_LAST_MAINTENANCE_SECONDS.labels("autocompact").set(seconds)
            metrics.LAKE_LAST_MAINTENANCE.labels("autocompact").set(time.time())


def _committed(dt: DeltaTable, attempt: str, read_version: int) -> bool:
    """Whether a commit after ``read_version`` is the rewrite ``attempt`` (read from the log again; an
    error reading it counts as committed: its files are then kept, orphans at worst)."""
    try:
        dt.update_incremental()
        now = dt.version()
        for entry in dt.history(max(1, now - read_version)):
            if entry.get("version", -1) <= read_version:
                continue
            meta = json.loads(entry.get("cdcd", "{}"))
            if isinstance(meta, dict) and meta.get(COMMIT_TAG, {}).get("attempt") == attempt:
                return True
        return False
    except (DeltaError, OSError, ValueError):
        return True


def bound_changes(lake: LakeDir, policy: FilePolicy) -> Rewritten | None:
    """Every partition of ``<lake>/changes`` brought within the bound (the scheduled lane: partitions a
    writer without the bound landed in, e.g. an older cdcd). No JVM."""
    from cdcd.lake.table import CHANGES

    table = lake / CHANGES
    if not is_delta(table):
        return None
    return rewrite_partitions(open_delta(table), table, policy)


def bound_compacted(lake: LakeDir, policy: FilePolicy) -> dict[str, Rewritten]:
    """After a compaction: ``state``'s partitions brought within the bound by the same tiers, counting each
    partition's key-disjoint files (its longest sorted run by key) as one; each typed table holding more
    than ``policy.max_files - 1`` sorted runs by key written again as one (its overlapping files sorted and
    split: cdcd/lake/maintenance/clustered.py). Returns what was rewritten, per table (``state``,
    ``tables/<cache>``). No JVM."""
    from cdcd.lake.table import STATE, TABLES
    from cdcd.lake.typed.infer import KEY
    from cdcd.lake.typed.layout import list_tables

    out: dict[str, Rewritten] = {}
    state = lake / STATE
    if is_delta(state):
        done = rewrite_partitions(open_delta(state), state, policy, runs_by="key")
        if done is not None:
            out[STATE] = done
    for cache, path in sorted(list_tables(lake).items()):
        try:
            dt = open_delta(path)
            adds = pa.table(dt.get_add_actions(flatten=True))
            small = [f for f in ranged_files(adds, KEY) if f.size < policy.large_file_bytes]
            if len(sorted_runs(small)) <= policy.max_files - 1:
                continue
            started = time.monotonic()
            removed, added = recluster(dt, path, KEY, policy.file_rows)
            if removed:
                out[f"{TABLES}/{cache}"] = Rewritten(removed, added, 1, time.monotonic() - started)
        except (DeltaError, OSError) as exc:  # a table compaction skips: next time
            log.info("lake_autocompact_lost", table=str(path), error=describe(exc))
    return out
