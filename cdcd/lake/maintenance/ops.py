"""Maintenance and inspection of the Delta lake: ``cdcd lake optimize / vacuum / show / history``.

``show`` and ``history`` read the Delta logs (delta-rs and ``deltalog``: no JVM); ``optimize`` and
``vacuum`` are Spark jobs (the Maintainer runs them inside the sink's session).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import structlog
from deltalake.exceptions import DeltaError

from cdcd.faults import ExitCode, Fault
from cdcd.lake.deltalog import LOG_DIR, AppTransaction, app_transactions, read_commit
from cdcd.lake.maintenance.compact import COMPACT_APP_ID, NotADeltaLake, compacted_version, state_lag
from cdcd.lake.printable import printable
from cdcd.lake.reading.check import damaged_table, require_sound
from cdcd.lake.reading.readers import view_names
from cdcd.lake.storage import LakeDir, ObjectPath, is_delta, open_delta, spark_path
from cdcd.lake.table import CHANGES, CUTS, STATE
from cdcd.lake.table import TABLES as TYPED_DIR
from cdcd.lake.typed.layout import CACHE_PROPERTY, scan_tables, table_dir
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")

TABLES = (CHANGES, STATE)
LAKE_TABLES = (CHANGES, STATE, CUTS)
"""The tables ``lake history`` knows by their own name (the typed ones are ``tables/<cache>``)."""

DEFAULT_RETAIN_HOURS = 168.0
"""Delta's own default (7 days): files a reader of an older snapshot may still need are kept that long."""


class VacuumRefused(Fault, ValueError):
    """Vacuuming now would delete files the next compaction still has to read."""

    exit_code = ExitCode.BAD_INPUT


def iso_ms(ts_ms: int | None) -> str | None:
    if ts_ms is None:
        return None
    return datetime.fromtimestamp(ts_ms / 1000, UTC).isoformat(timespec="milliseconds")


@dataclass
class TableInfo:
    name: str
    version: int
    last_commit: str | None
    last_operation: str | None
    files: int
    rows: int
    rows_per_cache: dict[str, int] = field(default_factory=dict)
    app_transactions: dict[str, int] = field(default_factory=dict)
    """app id -> version (the changes table: per source node; state: ``cdcd-compact``)."""


@dataclass
class LakeInfo:
    lake: str
    tables: list[TableInfo]
    compacted_to: int
    """The changes-table version ``state`` reflects (-1: never compacted)."""
    state_behind: bool | None
    """None when there is no changes table."""


def _table_info(path: LakeDir, name: str) -> TableInfo | None:
    if not is_delta(path):
        return None
    table = open_delta(path)
    version = table.version()
    last = table.history(1)
    adds = pa.table(table.get_add_actions(flatten=True))
    per_cache: dict[str, int] = {}
    caches = adds.column("partition.cache").to_pylist() if "partition.cache" in adds.column_names else []
    counts = adds.column("num_records").to_pylist() if "num_records" in adds.column_names else []
    missing_stats = any(c is None for c in counts)
    if missing_stats:
        # A writer that recorded no statistics: count for real (reads the files).
        data = table.to_pyarrow_dataset().to_table(columns=["cache"]).column("cache").to_pylist()
        for cache in data:
            per_cache[cache] = per_cache.get(cache, 0) + 1
    else:
        for cache, n in zip(caches, counts, strict=True):
            per_cache[cache] = per_cache.get(cache, 0) + int(n)
    txns: dict[str, AppTransaction] = app_transactions(path, version)
    return TableInfo(
        name=name,
        version=version,
        last_commit=iso_ms(last[0].get("timestamp")) if last else None,
        last_operation=last[0].get("operation") if last else None,
        files=adds.num_rows,
        rows=sum(per_cache.values()),
        rows_per_cache=dict(sorted(per_cache.items())),
        app_transactions={app: t.version for app, t in sorted(txns.items())},
    )


def show(lake: LakeDir) -> LakeInfo:
    """Both tables from their logs; ``NotADeltaLake`` when neither is a Delta table, DamagedLake
    when a log (or a file it names) is damaged, before delta-rs fails on it without naming a file."""
    require_sound(lake)
    tables = [info for name in TABLES if (info := _table_info(lake / name, name)) is not None]
    if not tables:
        raise NotADeltaLake(f"{lake}: no Delta table ({CHANGES}/ or {STATE}/ with a _delta_log/)")
    behind: bool | None = None
    if any(t.name == CHANGES for t in tables):
        behind = state_lag(lake)[2]
    return LakeInfo(str(lake), tables, compacted_version(lake), behind)


class UnknownTable(Fault, ValueError):
    """``lake history --table`` named no table of the lake: the line lists those it has."""

    exit_code = ExitCode.BAD_INPUT


@dataclass(frozen=True)
class NamedTable:
    """One Delta table of the lake by the name ``lake history`` prints: ``changes``, ``state``, ``_cuts`` or
    ``tables/<cache>``."""

    name: str
    path: LakeDir


TYPED_PREFIX = f"{TYPED_DIR}/"
LISTED_TABLES = 20
"""Typed tables an unknown name's error line lists at most (a lake may hold thousands)."""


def find_table(lake: LakeDir, name: str) -> NamedTable:
    """The table ``name`` stands for: ``changes``, ``state``, ``_cuts``, or a typed table by its cache's name
    (``orders``, ``tables/orders``: the prefix says a typed table where a cache is named ``state``), by its
    directory under ``tables/``, or by its view name in ``lake sql`` (a cache whose name holds a NUL or a
    newline can be typed that way: ``#{0}``). ``UnknownTable`` (one line listing the lake's tables) else."""
    if name in LAKE_TABLES:
        return NamedTable(name, lake / name)
    cache = name.removeprefix(TYPED_PREFIX)
    if cache:
        direct = _typed_by_name(lake, cache)
        if direct is not None:
            return direct
    typed = _typed_tables(lake)
    for found_cache, path in typed:
        if cache and path.name == cache:
            return NamedTable(_typed_name(found_cache, path), path)
    views = view_names(c for c, _ in typed if c is not None)
    by_cache = {c: path for c, path in typed if c is not None}
    if cache in views:
        return NamedTable(_typed_name(views[cache], by_cache[views[cache]]), by_cache[views[cache]])
    present = [t for t in LAKE_TABLES if is_delta(lake / t)]
    listed = [f"{TYPED_PREFIX}{view}" for view in sorted(views)] + [
        f"{TYPED_PREFIX}{path.name}" for c, path in typed if c is None
    ]
    more = f" and {len(listed) - LISTED_TABLES} more" if len(listed) > LISTED_TABLES else ""
    there = ", ".join([*present, *listed[:LISTED_TABLES]]) or "none"
    raise UnknownTable(f"{lake}: no table {printable(name)!r}; tables there: {there}{more}")


def _typed_name(cache: str | None, path: LakeDir) -> str:
    return TYPED_PREFIX + (printable(cache) if cache is not None else path.name)


def _typed_by_name(lake: LakeDir, cache: str) -> NamedTable | None:
    """The typed table of ``cache`` where its name puts it, if its ``cdcd.cache`` property says it is that
    cache's (one read of its log, not a scan of every table); a table delta-rs cannot open is taken on its
    place alone (its history then names what is damaged)."""
    path = table_dir(lake, cache)
    if not is_delta(path):
        return None
    try:
        found = open_delta(path).metadata().configuration.get(CACHE_PROPERTY)
    except Exception:  # a damaged log: ``history`` says which file
        return NamedTable(_typed_name(cache, path), path)
    return NamedTable(_typed_name(cache, path), path) if found == cache else None


def _typed_tables(lake: LakeDir) -> list[tuple[str | None, LakeDir]]:
    """(cache, path) of every typed table: those delta-rs opens and those it cannot (cache None when unknown)."""
    tables = scan_tables(lake)
    return [*sorted(tables.found.items()), *((bad.cache, bad.path) for bad in tables.unreadable)]


def history(lake: LakeDir, table: str, limit: int | None) -> list[dict[str, Any]]:
    """The table's commits, newest first: version, time, operation, its parameters and metrics (``table`` as
    ``find_table`` takes it). ``DamagedLake`` naming the file when the log cannot be read."""
    return table_history(find_table(lake, table).path, limit)


def table_history(path: LakeDir, limit: int | None) -> list[dict[str, Any]]:
    """``history`` of the Delta table at ``path``."""
    if not is_delta(path):
        raise NotADeltaLake(f"{path}: not a Delta table (no _delta_log/)")
    try:
        commits = open_delta(path).history(limit)
    except Exception as exc:
        damaged = damaged_table(path)
        if damaged is not None:
            raise damaged from exc
        raise
    out = []
    for commit in commits:
        out.append(
            {
                "version": commit.get("version"),
                "time": iso_ms(commit.get("timestamp")),
                "operation": commit.get("operation"),
                "parameters": commit.get("operationParameters") or {},
                "metrics": commit.get("operationMetrics") or {},
                "engine": commit.get("engineInfo") or commit.get("clientVersion"),
            }
        )
    return out


_MIN_FILE_SIZE = "spark.databricks.delta.optimize.minFileSize"
OPTIMIZE_MIN_FILE_BYTES = 64 << 20
"""Files at least this large are left alone by OPTIMIZE (unless ``spark_conf`` sets
``spark.databricks.delta.optimize.minFileSize``): a frequent scheduled run then rewrites the recent
small files of a partition, not all of it every time (Delta's default is 1 GiB)."""


def optimize(spark: Any, lake: LakeDir, file_rows: int | None = None) -> dict[str, dict[str, Any]]:
    """Bin-pack the small files of ``changes`` (Delta OPTIMIZE, per partition) and merge the overlapping files
    of ``state`` and the typed tables into key-range sorted runs of ``file_rows`` rows per file (None: the
    default, ``clustered.FILE_ROWS``). The commits change no data (readers, the change data feed and
    compaction see the same rows); returns Delta's metrics per table: ``numFilesRemoved`` small files
    rewritten as ``numFilesAdded``, of ``totalConsideredFiles`` (no commit when there was nothing to rewrite)."""
    from delta.tables import DeltaTable

    session = spark.newSession()
    if spark.conf.get(_MIN_FILE_SIZE, None) is None:
        session.conf.set(_MIN_FILE_SIZE, str(OPTIMIZE_MIN_FILE_BYTES))
    out: dict[str, dict[str, Any]] = {}
    for name, path in maintained_tables(lake):
        if not DeltaTable.isDeltaTable(session, spark_path(path)):
            continue
        if name != CHANGES:
            # Key-range clustered (cdcd/lake/maintenance/clustered.py): Delta's bin-packing would pack the ranges
            # back into one file, which the next compaction would cut again whole; their overlapping files are
            # merged into sorted runs instead, without Spark.
            out[name] = _optimize_clustered(name, path, file_rows)
            log.info("lake_optimized", table=name, **out[name])
            continue
        row = DeltaTable.forPath(session, spark_path(path)).optimize().executeCompaction().collect()[0]
        metrics = row["metrics"].asDict(recursive=True)
        out[name] = {k: metrics.get(k) for k in ("numFilesAdded", "numFilesRemoved", "totalConsideredFiles")}
        log.info("lake_optimized", table=name, **out[name])
    return out


def _optimize_clustered(name: str, path: LakeDir, file_rows: int | None) -> dict[str, Any]:
    """``state`` (its partitions' files beyond one sorted run, by the bound's tiers) or a typed table (its
    overlapping files merged into one sorted run): Delta's OPTIMIZE metrics' names."""
    from cdcd.lake.maintenance.autocompact import FilePolicy, rewrite_partitions
    from cdcd.lake.maintenance.clustered import FILE_ROWS, recluster
    from cdcd.lake.typed.infer import KEY

    dt = open_delta(path)
    considered = len(dt.file_uris())
    if name == STATE:
        policy = FilePolicy() if file_rows is None else FilePolicy(file_rows=file_rows)
        done = rewrite_partitions(dt, path, policy, runs_by="key")
        removed, added = (done.removed, done.added) if done is not None else (0, 0)
    else:
        removed, added = recluster(dt, path, KEY, FILE_ROWS if file_rows is None else file_rows)
    return {"numFilesAdded": added, "numFilesRemoved": removed, "totalConsideredFiles": considered}


OPTIMIZE_LOOKBACK_COMMITS = 200
"""Newest commits of ``changes`` searched for a recent OPTIMIZE (a busy table commits several a second)."""


def optimized_since(lake: LakeDir, since_ms: int, max_commits: int = OPTIMIZE_LOOKBACK_COMMITS) -> int | None:
    """The version of the newest OPTIMIZE commit of ``<lake>/changes`` made at or after ``since_ms``
    (wall time), among its newest ``max_commits`` commits; None when there is none (or no table). The
    Maintainer asks before its own run: a neighbour's OPTIMIZE of the same files moments ago did the work,
    and a second one would only rewrite the same small files again, or lose to it."""
    changes = lake / CHANGES
    if not is_delta(changes):
        return None
    latest = int(open_delta(changes).version())
    for version in range(latest, max(latest - max_commits, -1), -1):
        try:
            actions = read_commit(changes, version)
        except FileNotFoundError:
            return None  # cleaned up by log retention: older than anything asked about
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), None)
        if info is None or int(info.get("timestamp", 0)) < since_ms:
            return None  # commits are in time order: the rest are older still
        if info.get("operation") == "OPTIMIZE":
            return version
    return None


def maintained_tables(lake: LakeDir) -> list[tuple[str, LakeDir]]:
    """(name, path) of every table optimize and vacuum look after: changes, state, and each typed
    table (named ``tables/<cache>``)."""
    from cdcd.lake.table import TABLES as TYPED_DIR
    from cdcd.lake.typed.layout import list_tables

    typed = [(f"{TYPED_DIR}/{cache}", path) for cache, path in sorted(list_tables(lake).items())]
    return [(name, lake / name) for name in TABLES] + typed


def commit_time_ms(table: LakeDir, version: int) -> int:
    """When a commit was made (its commitInfo; 0 when its log file is gone: older than any horizon)."""
    try:
        actions = read_commit(table, version)
    except FileNotFoundError:
        return 0
    for action in actions:
        info = action.get("commitInfo")
        if info is not None and "timestamp" in info:
            return int(info["timestamp"])
    commit_file = table / LOG_DIR / f"{version:020d}.json"
    if not isinstance(commit_file, Path):
        return 0
    return int(commit_file.stat().st_mtime * 1000)


def data_files_on_disk(table: LakeDir) -> list[Any]:
    """Every Parquet data file under the table's directory, committed or not (what vacuum may delete)."""
    return [p for p in table.rglob("*.parquet") if LOG_DIR not in p.parts]


HOUR_MS = 3_600_000
KEEP_MARGIN_HOURS = 1
"""Kept beyond what a rule measures: a file is written before the commit that adds it."""


def cut_keep_hours(table: LakeDir, dt: Any, named: int | None, now_ms: int) -> int:
    """Hours ``table`` (a typed table, ``dt`` its latest snapshot) must keep so the version the latest cut names
    (``named``) stays readable: the age of the oldest file that version names and the latest no longer does, plus a
    margin. By the file's age, not by when it was replaced: once a checkpoint has dropped its tombstone the vacuum
    judges it by its modification time. 0 when the cut names the latest version (or none), or a version whose log
    is gone (no reader can open it any more)."""
    if named is None or named >= dt.version():
        return 0
    try:
        at_cut = open_delta(table, version=named)
    except (DeltaError, OSError) as exc:
        log.warning("lake_cut_version_unreadable", table=str(table), version=named, error=describe(exc))
        return 0
    replaced = set(_paths(at_cut)) - set(_paths(dt))
    ages = [now_ms - f.mtime_ms for f in existing_files(table, sorted(replaced)).values()]
    if not ages:
        return 0
    return math.ceil(max(0, *ages) / HOUR_MS) + KEEP_MARGIN_HOURS


def _paths(dt: Any) -> list[str]:
    paths: list[str] = pa.table(dt.get_add_actions(flatten=True)).column("path").to_pylist()
    return paths


class FileStat(NamedTuple):
    size: int
    mtime_ms: int


def existing_files(table: LakeDir, paths: list[str]) -> dict[str, FileStat]:
    """Size and modification time of the files of ``paths`` (relative to ``table``) that exist."""
    out: dict[str, FileStat] = {}
    for rel in paths:
        path = table / rel
        if isinstance(path, ObjectPath):
            info = path.fs.get_file_info(path.fs_path)
            if info.size is not None:  # None: no such object
                out[rel] = FileStat(int(info.size), (info.mtime_ns or 0) // 1_000_000)
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out[rel] = FileStat(st.st_size, st.st_mtime_ns // 1_000_000)
    return out


def check_vacuum(lake: LakeDir, retain_hours: float, now_ms: int | None = None, *, force: bool = False) -> None:
    """``VacuumRefused`` when ``retain_hours`` is below Delta's default without ``force``, or changes not
    yet compacted were committed before the retention horizon."""
    if retain_hours < 0:
        raise VacuumRefused(f"--retain-hours {retain_hours:g}: must be >= 0")
    if retain_hours < DEFAULT_RETAIN_HOURS and not force:
        raise VacuumRefused(
            f"--retain-hours {retain_hours:g} is below Delta's default retention ({DEFAULT_RETAIN_HOURS:g} h): "
            "a reader of an older snapshot (time travel, a query or stream in flight) may lose files it still "
            "needs; add --force to vacuum anyway (the retention check is then off for that run)"
        )
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    horizon_ms = now_ms - int(retain_hours * 3600 * 1000)
    changes = lake / CHANGES
    if not is_delta(changes):
        return
    _, done, behind = state_lag(lake)
    if behind:
        first_ms = commit_time_ms(changes, done + 1)
        if first_ms < horizon_ms:
            raise VacuumRefused(
                f"{lake}: changes from version {done + 1} ({iso_ms(first_ms)}) are not compacted yet and "
                f"older than {retain_hours:g} h: run `cdcd lake compact --lake {lake}` first"
            )


@dataclass(frozen=True)
class Vacuumed:
    """One table's vacuum, measured on its directory (Delta's VACUUM reports no figures)."""

    deleted_files: int
    deleted_bytes: int
    files_left: int


def data_file_sizes(table: LakeDir) -> dict[str, int]:
    """Size of every Parquet data file under the table's directory (``data_files_on_disk``), by path."""
    return {str(p): p.size() if isinstance(p, ObjectPath) else p.stat().st_size for p in data_files_on_disk(table)}


__all__ = [
    "COMPACT_APP_ID",
    "LakeInfo",
    "NamedTable",
    "TableInfo",
    "UnknownTable",
    "VacuumRefused",
    "Vacuumed",
    "find_table",
    "history",
    "optimize",
    "optimized_since",
    "show",
    "table_history",
]
