"""The lake's replaced files deleted by the maintainer, with delta-rs (no JVM): the scheduled vacuum.

Nothing else deletes a data file: a file the small-file bound, OPTIMIZE or compaction's MERGE replaces stays in its
table's directory (its ``remove`` is a tombstone), and each MERGE into a typed table writes its change data feed
(``_change_data/``), which nothing replaces. A live lake's directory grows by gigabytes an hour.

Each run vacuums ``changes``, ``state`` and every typed table in delta-rs's full mode, which deletes a file under
the table that its snapshot does not name once it is older than the retention: a replaced file by its tombstone's
time (when it was replaced) while the snapshot still carries the tombstone, any other (one whose tombstone a
checkpoint dropped, a change data feed file, an orphan of a write that never committed) by its modification
time, as Spark's VACUUM does. Not the lite mode: it deletes only tombstones the snapshot still
carries, and ``changes`` keeps those 10 minutes, after which a checkpoint drops them for good. The retention:

- ``retain_hours`` (``vacuum_retain_hours``), or a table's ``delta.deletedFileRetentionDuration`` where it is set
  and longer (a value set by hand is kept; cdcd sets 10 minutes on ``changes``, which is shorter);
- for ``changes``, also the age of the first commit compaction has not folded plus an hour: compaction still reads
  the files those commits added, replaced by the bound since or not. A compaction stopped for days keeps its
  files that long (``cdcd lake vacuum`` refuses instead);
- for a typed table, also every file of the version the latest cut names (``cut_keep_hours``): readers open each
  typed table at that version (cdcd/lake/cuts.py), and the commits after it that no compaction recorded in a cut
  (the bound's and OPTIMIZE's rewrites right after a compaction, this vacuum's own commits) replace its files
  without changing its rows. While the source writes, the next compaction records a newer cut within seconds; a
  lake whose source has gone quiet keeps reading the last cut for as long as it stays quiet.

Tombstones and the log follow the same retention. A table's checkpoint carries every tombstone younger than its
``delta.deletedFileRetentionDuration`` (Delta's default: a week), and its log keeps every commit younger than its
``delta.logRetentionDuration`` (30 days; cdcd/lake/maintenance/log_cleanup.py deletes the older ones); delta-rs
reads the first and lists the second at every open. Compaction commits to ``state``, to each typed table and to
``_cuts`` every run and replaces files of the first two, so at Delta's defaults every open, and so every
compaction, would cost more by the day. Before each run the vacuum sets both properties on those tables to
``retain_hours`` (``align_retention``): a checkpoint then drops a tombstone once the vacuum would delete its file
anyway (from then on the vacuum judges the file by its modification time, which is older), and time travel reaches
back as far in the log as in the files. The value cdcd set is noted beside each (``cdcd.deletedFileRetentionDuration``,
``cdcd.logRetentionDuration``), so a change of ``vacuum_retain_hours`` moves it and a value set by hand (one that
differs from cdcd's note) is never touched. Not on ``changes``, which keeps its own 10 minutes and 2 minutes. On a
typed table Delta's own log cleanup goes off too (``delta.enableExpiredLogCleanup``, as on ``changes``): at a
checkpoint it would delete the log of the version the latest cut names, which cdcd's cleanup keeps.

A batch written and not yet committed is seconds old, never as old as the shortest retention (an hour), so it is
never deleted. A reader of a snapshot older than the retention may miss a file it names: time travel, the typed
tables' change data feed and a query in flight reach back ``retain_hours``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import structlog
from deltalake import DeltaTable
from deltalake.transaction import PostCommitHookProperties

from cdcd.lake.cuts import Cut, latest_cut
from cdcd.lake.maintenance.compact import state_lag
from cdcd.lake.maintenance.compact_mark import read_mark, replaced_from
from cdcd.lake.maintenance.log_cleanup import interval_ms
from cdcd.lake.maintenance.ops import (
    HOUR_MS,
    KEEP_MARGIN_HOURS,
    Vacuumed,
    check_vacuum,
    commit_time_ms,
    cut_keep_hours,
    data_file_sizes,
    existing_files,
    maintained_tables,
)
from cdcd.lake.storage import LakeDir, is_delta, open_delta
from cdcd.lake.table import CHANGES, CUTS, TABLES

log = structlog.get_logger("cdcd.lake")

RETENTION = "delta.deletedFileRetentionDuration"
LOG_RETENTION = "delta.logRetentionDuration"
EXPIRED_LOG_CLEANUP = "delta.enableExpiredLogCleanup"
SET_BY_CDCD = {RETENTION: "cdcd.deletedFileRetentionDuration", LOG_RETENTION: "cdcd.logRetentionDuration"}
"""Beside each property ``align_retention`` sets: the value cdcd set. Equal to it, the property is cdcd's to move;
different, set by hand."""


@dataclass(frozen=True)
class Swept:
    """One table's vacuum: the files deleted, their bytes, and the retention it ran with."""

    deleted_files: int
    deleted_bytes: int
    retain_hours: int


def table_retain_hours(dt: DeltaTable, retain_hours: int) -> int:
    """``retain_hours``, or the table's ``delta.deletedFileRetentionDuration`` where set and longer (whole hours,
    rounded up). An unreadable value keeps the longer of the two that Delta would use (its default, a week)."""
    text = dt.metadata().configuration.get(RETENTION)
    if not text:
        return retain_hours
    try:
        own_ms = interval_ms(text)
    except ValueError:
        own_ms = 7 * 24 * HOUR_MS
    return max(retain_hours, math.ceil(own_ms / HOUR_MS))


def align_retention(dt: DeltaTable, retain_hours: int, *, own_log_cleanup: bool = False) -> dict[str, str]:
    """``dt``'s tombstone and log retention set to ``retain_hours`` in one metadata commit (``dt`` brought up to
    date after it), each unless it is that already or was set by hand; returns what was set. ``own_log_cleanup``
    (a typed table): also Delta's own log cleanup off unless set by hand, since it would delete the log of the
    version the latest cut names once older than the retention (cdcd/lake/maintenance/log_cleanup.py keeps it)."""
    conf = dt.metadata().configuration
    want = f"interval {retain_hours} hours"
    changed: dict[str, str] = {}
    for prop, note in SET_BY_CDCD.items():
        have = conf.get(prop)
        if have != want and (have is None or have == conf.get(note)):
            changed |= {prop: want, note: want}
    if own_log_cleanup and EXPIRED_LOG_CLEANUP not in conf:
        changed[EXPIRED_LOG_CLEANUP] = "false"
    if changed:
        dt.alter.set_table_properties(changed, raise_if_not_exists=False)
        dt.update_incremental()
    return {prop: value for prop, value in changed.items() if prop.startswith("delta.")}


def changes_keep_hours(lake: LakeDir, now_ms: int) -> int | None:
    """Hours ``changes`` must keep for compaction (the age of the first commit it has not folded, plus a margin):
    0 when it is not behind; None when that commit's time cannot be read (keep everything)."""
    end, done, behind = state_lag(lake)
    if not behind:
        return 0
    replaced = replaced_from(lake / CHANGES, read_mark(lake), end)
    first = max(0, done + 1 if replaced is None else min(done + 1, replaced))
    since_ms = commit_time_ms(lake / CHANGES, first)
    if since_ms <= 0:
        return None
    return math.ceil(max(0, now_ms - since_ms) / HOUR_MS) + KEEP_MARGIN_HOURS


def existing_sizes(table: LakeDir, paths: list[str]) -> dict[str, int]:
    """Sizes of the files of ``paths`` (relative to ``table``) that exist."""
    return {rel: f.size for rel, f in existing_files(table, paths).items()}


def sweep_table(dt: DeltaTable, table: LakeDir, retain_hours: int, *, checkpoint: bool = True) -> Swept:
    """The files under ``table`` older than ``retain_hours`` that the snapshot ``dt`` holds does not name, deleted
    (delta-rs's full vacuum, which commits a VACUUM START and a VACUUM END when it deletes anything). Its plan
    also names the expired tombstones of files deleted before (until a checkpoint drops them): only a plan with a
    file that still exists runs."""
    hooks = PostCommitHookProperties(create_checkpoint=checkpoint, cleanup_expired_logs=False)
    sizes = existing_sizes(table, dt.vacuum(retain_hours, dry_run=True, enforce_retention_duration=False, full=True))
    if not sizes:
        return Swept(0, 0, retain_hours)
    deleted = set(
        dt.vacuum(
            retain_hours, dry_run=False, enforce_retention_duration=False, full=True, post_commithook_properties=hooks
        )
    )
    gone = [rel for rel in sizes if rel in deleted]
    return Swept(len(gone), sum(sizes[rel] for rel in gone), retain_hours)


def sweep_lake(lake: LakeDir, retain_hours: int, *, now_ms: int | None = None) -> dict[str, Swept]:
    """Every maintained table of the lake vacuumed (see the module doc); per table what it deleted. ``changes``
    is left alone while the commit compaction must read first has no readable time."""
    if retain_hours < 1:
        raise ValueError(f"vacuum_retain_hours = {retain_hours}: must be >= 1")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    cut = latest_cut(lake)
    out: dict[str, Swept] = {}
    for name, path in maintained_tables(lake):
        if not is_delta(path):
            continue
        dt = open_delta(path)
        if name != CHANGES:
            _align(name, dt, retain_hours, own_log_cleanup=name.startswith(f"{TABLES}/"))
        hours = table_retain_hours(dt, retain_hours)
        if name == CHANGES:
            keep = changes_keep_hours(lake, now_ms)
            if keep is None:
                log.warning("lake_vacuum_skipped", table=name, reason="compaction's next commit has no readable time")
                continue
            hours = max(hours, keep)
        hours = max(hours, _cut_keep_hours(name, path, dt, cut, now_ms))
        done = sweep_table(dt, path, hours, checkpoint=name != CHANGES)
        out[name] = done
        if done.deleted_files:
            log.info(
                "lake_vacuumed",
                table=name,
                retain_hours=hours,
                deleted=done.deleted_files,
                deleted_bytes=done.deleted_bytes,
            )
    if is_delta(lake / CUTS):
        _align(CUTS, open_delta(lake / CUTS), retain_hours)
    return out


def _cut_keep_hours(name: str, path: LakeDir, dt: DeltaTable, cut: Cut | None, now_ms: int) -> int:
    """``cut_keep_hours`` for a typed table (``tables/<cache>``) and the version ``cut`` names of it; 0 otherwise."""
    prefix = f"{TABLES}/"
    if cut is None or not name.startswith(prefix):
        return 0
    return cut_keep_hours(path, dt, cut.tables.get(name[len(prefix) :]), now_ms)


def _align(name: str, dt: DeltaTable, retain_hours: int, *, own_log_cleanup: bool = False) -> None:
    aligned = align_retention(dt, retain_hours, own_log_cleanup=own_log_cleanup)
    if aligned:
        log.info("lake_retention_set", table=name, properties=aligned)


def vacuum(
    lake: LakeDir, retain_hours: float, now_ms: int | None = None, *, force: bool = False
) -> dict[str, Vacuumed]:
    """``cdcd lake vacuum``: every maintained table's files no snapshot of the last ``retain_hours`` needs deleted
    (whole hours, rounded up), as the scheduled vacuum deletes them and with the same keeps (a typed table's files
    of the version the latest cut names). Refused (``VacuumRefused``, before anything is deleted) when changes not
    compacted yet are older than that (compaction still reads their files), and below Delta's default retention
    without ``force``. Per table: the data files deleted, their bytes, and the data files left.

    delta-rs, not Spark's VACUUM: Spark's deletes a file no snapshot names once it is older than the table's
    ``delta.deletedFileRetentionDuration`` whatever the retention it is given, so it could keep neither a longer
    ``--retain-hours`` nor a cut's files; and no JVM starts."""
    check_vacuum(lake, retain_hours, now_ms, force=force)
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    hours = math.ceil(retain_hours)
    cut = latest_cut(lake)
    out: dict[str, Vacuumed] = {}
    for name, path in maintained_tables(lake):
        if not is_delta(path):
            continue
        dt = open_delta(path)
        keep = max(hours, _cut_keep_hours(name, path, dt, cut, now_ms))
        before = data_file_sizes(path)  # the Parquet files: not the checksum files beside some, which go too
        sweep_table(dt, path, keep, checkpoint=name != CHANGES)
        after = data_file_sizes(path)
        gone = before.keys() - after.keys()
        out[name] = Vacuumed(len(gone), sum(before[p] for p in gone), len(after))
        log.info("lake_vacuumed", table=name, retain_hours=keep, deleted=len(gone), files=len(after))
    return out
