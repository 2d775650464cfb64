"""``cdcd lake compact``: MERGE the changes since the last compaction into ``<lake>/state``.

One job for all caches, on Spark or, without a JVM, on delta-rs and pyarrow (``compact(None, lake)``;
the daemon's choice is its ``compact_engine``, docs/lake.md). It reads the change data feed of
``<lake>/changes`` from the version after the last compacted one up to the table's current version,
keeps per (cache, key) the change with the highest version order, then WAL position, and MERGEs that
into ``state``: deletes remove the row, anything else replaces an older one. The MERGE commit carries the application
transaction ``(COMPACT_APP_ID, changes version compacted up to)``: Delta skips a commit whose
version is not above the recorded one, so a compaction that died (anywhere, even after its commit)
and runs again either finds nothing left to do or redoes exactly the uncommitted range.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog

from cdcd import failpoints
from cdcd.faults import ExitCode, Fault
from cdcd.lake.deltalog import data_changing_versions, rows_added
from cdcd.lake.landing.arrow import TRUNCATE
from cdcd.lake.maintenance.clustered import FILE_ROWS
from cdcd.lake.maintenance.compact_mark import (
    COMPACT_APP_ID,
    USER_METADATA_CONF,
    CompactMark,
    commit_ids,
    compact_app_id,
    read_mark,
    replaced_from,
)
from cdcd.lake.maintenance.feed import FEED_COLUMNS, read_feed
from cdcd.lake.maintenance.lost_history import drop_lost, generation_starts, start_ids
from cdcd.lake.maintenance.state_rs import Prepared, ensure_state, prepare_state
from cdcd.lake.storage import LakeDir, is_delta, open_delta, spark_path
from cdcd.lake.table import CHANGE_SCHEMA, CHANGES, ORDER_COLUMNS, PARTITION_BY, STATE, STATE_SCHEMA
from cdcd.lake.typed.declared import DeclaredTable
from cdcd.lake.typed.layout import BadTable, list_tables, scan_tables
from cdcd.lake.typed.tables import compact_tables, missing_tables

log = structlog.get_logger("cdcd.lake")

__all__ = [
    "COMPACT_APP_ID",
    "FEED_COLUMNS",
    "MAX_ROWS_PER_MERGE",
    "ORDER_COLUMNS",
    "CompactResult",
    "NotADeltaLake",
    "behind",
    "compact",
    "compact_engine",
    "compacted_version",
    "latest_per_key",
    "read_feed",
    "split_truncates",
    "state_lag",
    "table_version",
    "version_ranges",
]

MAX_ROWS_PER_MERGE = 2_000_000
"""Change rows one MERGE reads into the driver at most (a backlog is compacted in several MERGEs)."""

STATE_COLUMNS = tuple(STATE_SCHEMA.names)
_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"


ENGINES = ("auto", "spark", "deltalake")
"""``compact_engine`` (the lake sink's option) and ``cdcd lake compact --engine``."""


def compact_engine(choice: str, spark_master: str | None, *, spark_writer: bool) -> Literal["spark", "deltalake"]:
    """Which engine compacts: ``choice`` itself, or for ``auto`` Spark when the writer is Spark's or a Spark
    master is named, delta-rs (no JVM) otherwise. ``ValueError`` (naming the choices) for anything else."""
    if choice == "auto":
        return "spark" if spark_writer or spark_master else "deltalake"
    if choice == "spark":
        return "spark"
    if choice == "deltalake":
        return "deltalake"
    raise ValueError(f"{choice!r}: expected one of {', '.join(ENGINES)}")


class NotADeltaLake(Fault, ValueError):
    """``<lake>/changes`` is not a Delta table."""

    exit_code = ExitCode.BAD_INPUT


@dataclass(frozen=True)
class CompactResult:
    from_version: int
    """First changes-table version folded in (-1: nothing to do)."""
    to_version: int
    """The changes-table version ``state`` now reflects (the compact application transaction)."""
    keys: int
    """Distinct (cache, key) read from the changes: each key's latest change, offered to the MERGE."""
    state_version: int
    """The state table's version after the MERGE (unchanged when nothing was new)."""
    tables: dict[str, int] = dc_field(default_factory=dict)
    """cache -> version of its typed table ``<lake>/tables/<cache>`` after this compaction."""
    rescued: int = 0
    """Fields that did not fit their typed column and went to ``_rescued``."""
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    """Rows of ``state`` the MERGEs inserted, updated and deleted (Delta's own MERGE metrics). The
    rest of ``keys`` changed nothing: a delete of a key state never had, or a change older than
    state's row."""
    skipped: list[BadTable] = dc_field(default_factory=list)
    """Typed tables that could not be opened or compacted: each named in one line, left out of the cut
    (``state`` and every other table are current); a failed one is rebuilt from ``state`` next time."""
    behind: bool = False
    """Changes committed after ``to_version`` were left for the next run (``max_rows_per_run``)."""

    @property
    def upserted(self) -> int:
        return self.inserted + self.updated

    @property
    def did_work(self) -> bool:
        return self.from_version >= 0


def table_version(path: LakeDir) -> int | None:
    """The latest version of the Delta table at ``path`` (None: no table there). Reads the log only."""
    if not is_delta(path):
        return None
    return int(open_delta(path).version())


def compacted_version(lake: LakeDir) -> int:
    """The changes-table version ``state`` reflects (-1: never compacted)."""
    return read_mark(lake).version


def _start(lake: LakeDir, end: int, starts: list[str]) -> tuple[int, str, bool]:
    """(the changes version to fold in after, the application id of state's commits, whether to
    rebuild): the mark; or, when a version it names was replaced by another commit, the version
    before it in the next epoch; or, when a source started a generation since (a node restored from a
    backup: cdcd/lake/maintenance/lost_history.py), everything again in the next epoch."""
    mark: CompactMark = read_mark(lake)
    new = set(starts) - mark.generation_starts if mark.generation_starts is not None else set()
    if new and mark.version >= 0:
        log.warning(
            "lake_state_rebuilt_for_generation",
            changes=str(lake / CHANGES),
            generations=sorted(new),
            detail="a source continues as a new generation (node restored from a backup): state and the typed "
            "tables are rebuilt from changes without the lost history's rows",
        )
        return -1, compact_app_id(mark.epoch + 1), True
    replaced = replaced_from(lake / CHANGES, mark, end)
    if replaced is None:
        return mark.version, mark.app_id, False
    log.warning(
        "lake_compacted_version_replaced",
        changes=str(lake / CHANGES),
        version=replaced,
        compacted_to=mark.version,
        detail="a changes commit state reflects is gone and its version reused (newest commit deleted, lake "
        "restored?): compacting again from it",
    )
    return replaced - 1, compact_app_id(mark.epoch + 1), False


def ensure_state_table(lake: LakeDir) -> None:
    """Create ``<lake>/state`` (empty, the contract's schema, partitioning and properties) if absent. With
    delta-rs whatever the engine: a table any reader and either engine's MERGE takes, without a Spark job."""
    ensure_state(lake)


def latest_per_key(feed: pa.Table) -> pa.Table:
    """Per (cache, key), the change with the highest version order, then WAL position (of equals, the later
    row). Rows without a cache or key are each their own (no key to match)."""
    if feed.num_rows == 0:
        return feed
    # The numeric order columns sorted (stably), then the last row of each (cache, key) in that order by a
    # hash aggregation: no sort of the string columns, which cost the most at an interval's size.
    order = pc.sort_indices(feed, sort_keys=[(c, "ascending") for c in ORDER_COLUMNS])
    cache, key = feed.column("cache").take(order), feed.column("key").take(order)
    keyed = pc.and_(pc.is_valid(cache), pc.is_valid(key))
    rows = pa.table({"cache": cache, "key": key, "row": order}).filter(keyed)
    last = rows.group_by(["cache", "key"], use_threads=False).aggregate([("row", "last")]).column("row_last")
    keyless = order.filter(pc.invert(keyed))
    return feed.take(np.concatenate([last.to_numpy(), keyless.to_numpy()]))


def split_truncates(feed: pa.Table) -> tuple[pa.Table, frozenset[str]]:
    """The feed without its ``truncate`` rows (cache drops) and without the rows each one makes
    obsolete: the same source's rows of that cache before it, in (generation, WAL position) order.
    Also the caches dropped: ``state`` rows of theirs, from earlier ranges, are all older."""
    feed = feed.set_column(
        feed.schema.get_field_index("source_generation"),
        "source_generation",
        feed.column("source_generation").fill_null(0),
    )
    is_truncate = pc.equal(feed.column("op"), TRUNCATE)
    truncates = feed.filter(is_truncate)
    if not truncates.num_rows:
        return feed.select(list(FEED_COLUMNS)), frozenset()
    rows = feed.filter(pc.invert(is_truncate))
    drop = np.zeros(rows.num_rows, bool)
    cols = {c: rows.column(c).to_numpy(zero_copy_only=False) for c in ("cache", "source_node", *_POSITION)}
    for t in truncates.to_pylist():
        older = np.zeros(rows.num_rows, bool)
        equal = np.ones(rows.num_rows, bool)
        for c in _POSITION:  # (generation, segment, offset, index) < the truncate's, lexicographically
            older |= equal & (cols[c] < t[c])
            equal &= cols[c] == t[c]
        drop |= (cols["cache"] == t["cache"]) & (cols["source_node"] == t["source_node"]) & older
    kept = rows.filter(pa.array(~drop)).select(list(FEED_COLUMNS))
    return kept, frozenset(truncates.column("cache").to_pylist())


_POSITION = ("source_generation", "wal_segment", "wal_offset", "wal_index")


def _truncate_state(session: Any, lake: LakeDir, caches: frozenset[str]) -> int:
    """Delete every ``state`` row of the dropped caches (before the range's MERGE brings their rows
    after the drop; a compaction that dies in between deletes again when it redoes the range)."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    if not is_delta(lake / STATE):
        return 0
    table = DeltaTable.forPath(session, spark_path(lake / STATE))
    table.delete(F.col("cache").isin(sorted(caches)))
    metrics = table.history(1).select("operationMetrics").collect()[0][0] or {}
    log.info("lake_state_truncated", caches=sorted(caches), rows=metrics.get("numDeletedRows"))
    return int(metrics.get("numDeletedRows", 0))


def version_ranges(changes: LakeDir, start: int, end: int, max_rows: int) -> Iterator[tuple[int, int]]:
    """``start..end`` cut into consecutive ranges of at most ``max_rows`` added rows each (a single
    larger version is a range of its own): what one MERGE holds in memory is bounded. One at a time: a run that
    folds only the first reads only its commits' stats."""
    first, rows = start, 0
    for version in range(start, end + 1):
        added = rows_added(changes, version)
        added = max_rows if added is None else added
        if rows and rows + added > max_rows:
            yield first, version - 1
            first, rows = version, 0
        rows += added
    yield first, end


def _newer(source: str, target: str) -> str:
    """SQL: the source row's change is later than the target row's (struct comparison, field by field)."""
    cols = ", ".join(f"{source}.{c}" for c in ORDER_COLUMNS)
    tcols = ", ".join(f"{target}.{c}" for c in ORDER_COLUMNS)
    return f"struct({cols}) > struct({tcols})"


def compact(
    spark: Any | None,
    lake: LakeDir,
    *,
    max_rows_per_merge: int = MAX_ROWS_PER_MERGE,
    tables: Mapping[str, DeclaredTable] | None = None,
    typed_tables: bool = True,
    file_rows: int = FILE_ROWS,
    max_rows_per_run: int = 0,
) -> CompactResult:
    """Fold every change committed to ``<lake>/changes`` since the last compaction into ``<lake>/state``
    and the typed tables ``<lake>/tables/<cache>``: one MERGE per range of at most
    ``max_rows_per_merge`` change rows (one range unless a backlog). ``spark``: the SparkSession whose
    MERGEs write ``state`` and rebuild typed tables, or None: all of it with delta-rs and pyarrow in this
    process, no JVM (cdcd/lake/maintenance/state_rs.py); either way the same tables, the same marks, the
    same cut. ``tables``: declared column types per cache (``[consumer.tables.<cache>]``).
    ``typed_tables=False``: ``state`` alone (a lake of thousands of tiny caches; the benchmark's
    reference). Turning it on again later: delete ``<lake>/tables`` first, the next compaction rebuilds
    every table from ``state``. ``file_rows``: rows per file of ``state``'s and the typed tables' key-range
    clustered files (``compact_file_rows``, cdcd/lake/maintenance/clustered.py). ``max_rows_per_run``: fold at
    most this many change rows (whole commits; one commit larger than that alone), leaving the rest for the
    next run (``CompactResult.behind``); 0: all of them. A run's cost then follows the bound, not the backlog."""
    changes = lake / CHANGES
    end = table_version(changes)
    if end is None:
        raise NotADeltaLake(f"{changes}: not a Delta table (no _delta_log/): nothing to compact")
    # A directory under tables/ that is not a table stops compaction here, naming it; one that delta-rs cannot
    # open is named in every run's result (compact_tables logs it when it skips it).
    unreadable = scan_tables(lake).unreadable if typed_tables else []
    starts = generation_starts(changes, end)
    seen = start_ids(starts)
    done, app_id, rebuild = _start(lake, end, seen)
    # Its own session: the application-transaction settings are per session, and the lake sink may
    # commit through the process's main session at the same time.
    session = None if spark is None else spark.newSession()
    if not behind(changes, done, end):
        if not typed_tables or not missing_tables(lake):
            if typed_tables:
                _cut_if_behind(lake, done)
            return CompactResult(-1, done, 0, _state_version(lake), skipped=unreadable)
        # Nothing new, but state holds caches without a table (a lake compacted before the typed tables).
        empty = CHANGE_SCHEMA.empty_table()
        typed = compact_tables(session, lake, empty, done, app_id=app_id, declared=tables)
        _after_tables_committed(lake, typed.versions, done, typed.failed)
        return CompactResult(
            -1, done, 0, _state_version(lake), typed.versions, typed.rescued, skipped=_unique(typed.failed)
        )
    if session is not None:
        session.conf.set("spark.databricks.delta.merge.repartitionBeforeWrite.enabled", "true")
    ensure_state_table(lake)
    failpoints.hit("lake.compact.state_table")
    keys = rescued = inserted = updated = deleted = 0
    versions: dict[str, int] = {}
    skipped: list[BadTable] = []
    failed: list[BadTable] = []
    per_range = min(max_rows_per_merge, max_rows_per_run or max_rows_per_merge)
    ranges = list(itertools.islice(version_ranges(changes, done + 1, end, per_range), 1 if max_rows_per_run else None))
    folded_to = ranges[-1][1]
    for first, last in ranges:
        feed, lost = drop_lost(read_feed(changes, first, last), starts)
        feed, truncated = split_truncates(feed)
        if rebuild and first == 0:
            truncated |= _state_caches(lake, typed_tables)
        winners = latest_per_key(feed)
        keys += winners.num_rows
        failpoints.hit("lake.compact.source_read")
        # Without a JVM, state's new files are written while the typed tables merge (in a thread of its
        # own: its reads, typing and Parquet encoding release the GIL), and committed after them.
        pending = _prepare_state(lake, winners, truncated, file_rows) if session is None and typed_tables else None
        # The typed tables first: state's application transaction is the progress mark, so a
        # compaction killed between the two redoes this range (tables already past it are skipped).
        try:
            if typed_tables:
                typed = compact_tables(
                    session,
                    lake,
                    winners,
                    last,
                    app_id=app_id,
                    declared=tables,
                    truncated=truncated,
                    file_rows=file_rows,
                )
                versions, rescued, failed = typed.versions, rescued + typed.rescued, typed.failed
                skipped += typed.failed
            failpoints.hit("lake.compact.tables_committed")
            mark = commit_ids(changes, first, last, seen)
            prepared = None if pending is None else pending.result()
        except BaseException:
            _discard_prepared(pending)
            raise
        if session is None:
            # The drops, the MERGE, the transaction and the mark in one commit.
            if prepared is None:
                prepared = prepare_state(lake, winners, truncated, file_rows=file_rows)
            ins, upd, dele = prepared.commit(app_id=app_id, version=last, user_metadata=mark)
        else:
            ins, upd, dele = _spark_state(session, lake, winners, truncated, app_id=app_id, last=last, mark=mark)
        inserted, updated, deleted = inserted + ins, updated + upd, deleted + dele
        failpoints.hit("lake.compact.committed")
        if typed_tables:
            _after_tables_committed(lake, versions, last, failed)
        log.info(
            "lake_compacted", changes_from=first, changes_to=last, keys=winners.num_rows, rescued=rescued, lost=lost
        )
    state_version = _state_version(lake)
    return CompactResult(
        done + 1,
        folded_to,
        keys,
        state_version,
        versions,
        rescued,
        inserted,
        updated,
        deleted,
        _unique(skipped),
        behind=folded_to < end,
    )


def _prepare_state(
    lake: LakeDir, winners: pa.Table, truncated: frozenset[str], file_rows: int = FILE_ROWS
) -> Future[Prepared]:
    """``prepare_state`` in a thread of its own (a daemon thread: it never holds the process up at exit;
    compaction always waits for its result, to commit or to discard what it wrote)."""
    future: Future[Prepared] = Future()

    def run() -> None:
        try:
            future.set_result(prepare_state(lake, winners, truncated, file_rows=file_rows))
        except BaseException as exc:  # handed to the compaction, which raises it or discards it
            future.set_exception(exc)

    threading.Thread(target=run, name="cdcd-state-prepare", daemon=True).start()
    return future


def _discard_prepared(pending: Future[Prepared] | None) -> None:
    """The compaction failed before ``state``'s commit: the files prepared for it deleted (waiting for them
    to be written); one that cannot be deleted is logged, the compaction's own error is the one raised."""
    if pending is None or pending.exception() is not None:
        return  # nothing prepared (prepare_state deletes what it wrote before it raises)
    try:
        pending.result().discard()
    except OSError:
        log.warning("lake_state_prepare_not_discarded", exc_info=True)  # orphans: VACUUM's


def _spark_state(
    session: Any, lake: LakeDir, winners: pa.Table, truncated: frozenset[str], *, app_id: str, last: int, mark: str
) -> tuple[int, int, int]:
    """One range into ``state`` with Spark: the drops' delete, then the MERGE (a plain append into an empty
    table) carrying the application transaction and the mark. Rows (inserted, updated, deleted)."""
    deleted = 0
    if truncated:
        # Without an application transaction (an earlier range's is still set): Delta would skip
        # the commit as a repeat, or count it as the range's.
        session.conf.unset(_TXN_APP)
        session.conf.unset(_TXN_VERSION)
        deleted += _truncate_state(session, lake, truncated)
    session.conf.set(_TXN_APP, app_id)
    session.conf.set(_TXN_VERSION, str(last))
    session.conf.set(USER_METADATA_CONF, mark)
    try:
        source = session.createDataFrame(winners)
        if _is_empty(lake / STATE):
            # Nothing to match against (the first compaction): a plain append of the live winners,
            # same application transaction, no join. One writer per cache: one file per cache.
            live = source.where("op <> 'delete'").select(*STATE_COLUMNS).repartition(*PARTITION_BY)
            live.write.format("delta").mode("append").save(spark_path(lake / STATE))
            deletes = pc.sum(pc.equal(winners.column("op"), "delete")).as_py() or 0
            return winners.num_rows - deletes, 0, deleted
        ins, upd, dele = _merge(session, lake, source, winners.column("cache").unique().to_pylist())
        return ins, upd, deleted + dele
    finally:
        session.conf.unset(USER_METADATA_CONF)


def _unique(bad: list[BadTable]) -> list[BadTable]:
    """One per table (a table failing in every range of a backlog: its last error)."""
    return list({str(b.path): b for b in bad}.values())


def _state_caches(lake: LakeDir, typed_tables: bool) -> frozenset[str]:
    """Every cache ``state`` (and, with ``typed_tables``, a typed table) holds: emptied for a rebuild."""
    caches: set[str] = set()
    if is_delta(lake / STATE):
        adds = pa.table(open_delta(lake / STATE).get_add_actions(flatten=True))
        if adds.num_rows:
            caches |= set(adds.column("partition.cache").to_pylist())
    if typed_tables:
        caches |= set(list_tables(lake))
    return frozenset(caches)


def _after_tables_committed(
    lake: LakeDir, versions: dict[str, int], changes_version: int, failed: Sequence[BadTable] = ()
) -> None:
    """Once a range is committed to every typed table and to ``state``: record the cut they make
    (``versions``: cache -> table version; all reflect ``changes_version``; ``failed``: tables that do
    not, left out), cdcd/lake/cuts.py."""
    from cdcd.lake.cuts import record_cut, source_positions

    drop = [b.cache for b in failed if b.cache is not None]
    record_cut(lake, versions, source_positions(lake, changes_version), changes_version, drop=drop)


def _cut_if_behind(lake: LakeDir, done: int) -> None:
    """Nothing to compact, but no cut at ``done`` (a compaction killed after its commits, before its
    cut; a lake compacted before cuts existed): record the cut those commits make."""
    from cdcd.lake.cuts import latest_cut

    cut = latest_cut(lake)
    if done >= 0 and (cut is None or cut.changes_version < done):
        tables = {cache: int(open_delta(path).version()) for cache, path in list_tables(lake).items()}
        _after_tables_committed(lake, tables, done)


PRUNE_MAX_CACHES = 1000
"""Up to this many caches changed: the MERGE names them, so Delta reads only their state partitions."""


def _merge(session: Any, lake: LakeDir, source: Any, caches: list[str]) -> tuple[int, int, int]:
    """MERGE ``source`` into state; returns the rows inserted, updated and deleted (Delta's metrics)."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    condition = (F.col("t.cache") == F.col("s.cache")) & (F.col("t.key") == F.col("s.key"))
    if len(caches) <= PRUNE_MAX_CACHES:
        # Literal values (a Column, no SQL text): any cache name is safe here.
        condition = F.col("t.cache").isin(sorted(caches)) & condition
    assignments: dict[str, str | Any] = {c: f"s.`{c}`" for c in STATE_COLUMNS}
    metrics = (
        DeltaTable.forPath(session, spark_path(lake / STATE))
        .alias("t")
        .merge(source.alias("s"), condition)
        .whenMatchedDelete(condition=f"s.op = 'delete' AND {_newer('s', 't')}")
        .whenMatchedUpdate(condition=f"s.op <> 'delete' AND {_newer('s', 't')}", set=assignments)
        .whenNotMatchedInsert(condition="s.op <> 'delete'", values=assignments)
        .execute()
        .collect()[0]
    )
    return int(metrics["num_inserted_rows"]), int(metrics["num_updated_rows"]), int(metrics["num_deleted_rows"])


def _is_empty(table: LakeDir) -> bool:
    return not open_delta(table).file_uris()


def behind(changes: LakeDir, done: int, end: int) -> bool:
    """Whether versions ``done+1..end`` of the changes table hold data ``state`` lacks (commits that
    only rearrange files, such as OPTIMIZE, do not count)."""
    return next(data_changing_versions(changes, done, end), None) is not None


def state_lag(lake: LakeDir) -> tuple[int, int, bool]:
    """(changes version, changes version ``state`` reflects, whether ``state`` is behind)."""
    changes = lake / CHANGES
    end = table_version(changes)
    if end is None:
        raise NotADeltaLake(f"{changes}: not a Delta table (no _delta_log/)")
    mark = read_mark(lake)
    replaced = replaced_from(changes, mark, end)
    starts = set(start_ids(generation_starts(changes, end)))
    new = mark.version >= 0 and mark.generation_starts is not None and bool(starts - mark.generation_starts)
    return end, mark.version, new or replaced is not None or behind(changes, mark.version, end)


def _state_version(lake: LakeDir) -> int:
    version = table_version(lake / STATE)
    return -1 if version is None else version
