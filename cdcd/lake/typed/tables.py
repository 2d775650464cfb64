"""Compaction of the typed tables ``<lake>/tables/<cache>``: one per cache, one row per live key.

Called by ``compact`` for each range of the changes feed it folds, *before* the range's ``state``
MERGE: ``state``'s application transaction stays the one progress mark, and a table whose own
``cdcd-compact`` transaction already covers the range (a compaction killed between the two) is
skipped. Per cache with changes in the range: the winners are typed (``infer.convert``), new
columns are added by one ``ADD COLUMN`` commit (its own: the schema change is a line of the table's
history, the comments say when each column appeared), then one MERGE (or a plain append into an
empty table) applies them, carrying the application transaction. Both with delta-rs in this
process: a Spark MERGE per table costs a few Spark jobs each, which dominated compaction with ten
tables. delta-rs creates a table too (a Spark job would delay a new cache's first answer by seconds); a
rebuild is Spark's overwrite with the Spark engine, delta-rs's without a JVM. A cache whose
keys stop being one scalar type has its table rebuilt once with a JSON-text key from ``state``
(which holds that cache's rows as of the range's start), then merged. A column that widens
(``infer.join``: an int column meeting a double, a date column a timestamp, a scalar column a
string) has its table rewritten the same way, in one overwrite commit with the wider type (no Delta
type-widening feature, which not every reader reads), every row typed again from ``state``'s JSON (so
values rescued before that the wider type takes are restored into the column), then merged; so is,
once, a table typed before anything widened that holds rescued rows. A cache ``state`` holds but
that has no table (a lake compacted before the typed tables existed, or a table deleted to rebuild
it) gets its table from ``state`` the same way. Each table is key-range clustered
(cdcd/lake/maintenance/clustered.py): the MERGE names the key ranges its rows fall in, so delta-rs scans only
the files of those ranges, and the files it wrote (unsorted, spanning every range it touched) are merged into
the table's sorted run by one more commit that changes no data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog

from cdcd import failpoints, metrics
from cdcd.lake.maintenance.clustered import (
    FILE_ROWS,
    Ranged,
    assign,
    components,
    ranged_files,
    read_file,
    recluster,
    spread_wide,
    wide_run,
)
from cdcd.lake.properties import fold_properties
from cdcd.lake.storage import LakeDir, is_delta, open_delta, spark_path
from cdcd.lake.table import STATE
from cdcd.lake.typed.declared import DeclaredTable, with_declared
from cdcd.lake.typed.infer import KEY, OP, ORDER, RESCUED, Converted, Layout, convert
from cdcd.lake.typed.layout import (
    CACHE_PROPERTY,
    LATTICE,
    TABLE_PROPERTIES,
    BadTable,
    comments_for,
    quote,
    read_layout,
    scan_tables,
    schema_info,
    table_dir,
    widened_comment,
)
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")

TABLE_WORKERS = 2
"""Typed tables merged at the same time."""

STALE_MARK = "_cdcd_stale.json"
"""In a table's directory (a name Delta's readers and VACUUM leave alone): the table missed a range
(its compaction failed), so the next compaction rebuilds it from ``state`` before merging."""


@dataclass
class TablesResult:
    versions: dict[str, int]
    """cache -> table version after this range (every table under ``tables/`` but the failed)."""
    rescued: int
    columns_added: int
    failed: list[BadTable] = field(default_factory=list)
    """Tables skipped: unreadable, or their compaction failed (each logged in one line); ``state`` and
    the other tables went on without them."""


def compact_tables(
    spark: Any,
    lake: LakeDir,
    winners: pa.Table,
    last: int,
    *,
    app_id: str,
    declared: Mapping[str, DeclaredTable] | None = None,
    truncated: frozenset[str] = frozenset(),
    file_rows: int = FILE_ROWS,
) -> TablesResult:
    """Fold one range's winners (latest change per (cache, key), deletes included) into the typed tables.
    ``truncated``: caches dropped in the range: their tables are emptied first (``winners`` holds
    only their rows after the drop). ``file_rows``: rows per key-range clustered file."""
    declared = declared or {}
    scan = scan_tables(lake)
    tables = scan.found
    failed = list(scan.unreadable)
    unreadable = {str(bad.path) for bad in scan.unreadable}
    for bad in scan.unreadable:
        _failed(bad, "lake_table_unreadable")
    rescued = added = 0
    caches = set(winners.column("cache").unique().to_pylist()) if winners.num_rows else set()
    missing = sorted(c for c in _state_caches(lake) if c not in tables and str(table_dir(lake, c)) not in unreadable)
    clean = None if spark is None else spark.newSession()
    for cache in missing:
        # In state but without a table: the table starts as state's rows of the cache.
        path = table_dir(lake, cache)
        try:
            conv = convert(_state_rows(lake, cache), with_declared(Layout(), declared.get(cache)))
            _replace(clean, path, cache, conv)
        except Exception as exc:  # this table alone: named, marked to be rebuilt, the others go on
            if _cancelled(exc):
                raise
            failed.append(_mark_failed(path, cache, exc))
            continue
        tables[cache] = path
        rescued += conv.rescued
        log.info("lake_table_created_from_state", cache=cache, rows=conv.rows.num_rows)
    stale = {c for c, path in tables.items() if (path / STALE_MARK).exists()}
    jobs = []
    for cache in sorted(caches | stale | {c for c in truncated if c in tables}):
        path = tables.get(cache) or table_dir(lake, cache)
        if str(path) in unreadable:
            continue  # named above; state holds its rows, the table is rebuilt once its directory is deleted
        tables[cache] = path
        rows = winners.filter(pc.equal(winners.column("cache"), cache))
        jobs.append((cache, path, rows, declared.get(cache), cache in truncated, cache in stale))
    # Tables side by side: each MERGE is mostly a few short jobs and commits, so two at a time keep
    # the executors (or delta-rs's threads) busy while the other plans and commits.
    one_table = _one_table
    if spark is not None:
        from pyspark import inheritable_thread_target  # the maintainer's job group (cancel on stop) follows

        one_table = inheritable_thread_target(spark)(_one_table)
    with ThreadPoolExecutor(max_workers=TABLE_WORKERS, thread_name_prefix="cdcd-typed") as pool:
        futures = [pool.submit(one_table, spark, lake, job, app_id, last, file_rows=file_rows) for job in jobs]
        for job, future in zip(jobs, futures, strict=True):
            try:
                r, a = future.result()
            except Exception as exc:  # this table alone: named, marked to be rebuilt, the others go on
                if _cancelled(exc):
                    raise
                failed.append(_mark_failed(job[1], job[0], exc))
                tables.pop(job[0], None)
                continue
            rescued += r
            added += a
    versions = {}
    for cache, path in tables.items():
        try:
            versions[cache] = int(open_delta(path).version())
        except Exception as exc:  # committed, but unreadable now: named like the others
            failed.append(_mark_failed(path, cache, exc))
    return TablesResult(versions, rescued, added, failed)


_CANCELLED = re.compile(r"Job \d+ cancelled|cancelled job group|SparkContext (was|has been) shut ?down")


def _cancelled(exc: BaseException) -> bool:
    """A Spark job cancelled by the maintainer's stop (or the session ending): the whole compaction ends, no
    table is to blame."""
    return _CANCELLED.search(describe(exc)) is not None


def _failed(bad: BadTable, event: str) -> None:
    metrics.LAKE_TABLE_FAILURES.labels(cache=bad.cache or "").inc()
    log.error(event, path=str(bad.path), cache=bad.cache, error=bad.error)


def _mark_failed(path: LakeDir, cache: str, exc: BaseException) -> BadTable:
    """A table whose compaction failed: marked stale (before ``state``'s commit moves past the range, so
    the next compaction rebuilds it from ``state`` even after a crash) and named in one line."""
    bad = BadTable(path, cache, describe(exc))
    if is_delta(path):
        mark = {"cache": cache, "error": bad.error}
        try:
            (path / STALE_MARK).write_bytes(json.dumps(mark, ensure_ascii=False).encode())
        except OSError:
            raise exc from None  # unmarked, the table would stay behind unseen: the compaction fails instead
    _failed(bad, "lake_table_failed")
    return bad


def _one_table(
    spark: Any,
    lake: LakeDir,
    job: tuple[str, LakeDir, pa.Table, DeclaredTable | None, bool, bool],
    app_id: str,
    last: int,
    *,
    file_rows: int = FILE_ROWS,
) -> tuple[int, int]:
    """Type one cache's winners and merge them into its table: (fields rescued, columns added)."""
    cache, path, rows, declared, truncate, stale = job
    # A session of its own: no application transaction set by anyone else applies to its writes.
    spark = None if spark is None else spark.newSession()
    existing = is_delta(path)
    if existing and (open_delta(path).transaction_version(app_id) or -1) >= last:
        if stale:  # rebuilt and merged by a compaction that died before removing the mark
            (path / STALE_MARK).unlink(missing_ok=True)
        return 0, 0  # committed by a compaction that died before state's MERGE
    if truncate and existing:
        # The cache was dropped in this range: a new table, its types inferred afresh from the rows after
        # the drop (whatever compaction saw of the old cache), its history kept; nothing of the old
        # table is newer than the drop (a compaction that dies here replaces it again, the range's
        # transaction not being recorded yet).
        fresh = _fresh(rows, with_declared(Layout(), declared)).layout
        _replace(spark, path, cache, _fresh(rows.slice(0, 0), fresh), fresh_columns=True)
        log.info("lake_table_truncated", cache=cache)
        if stale:
            (path / STALE_MARK).unlink(missing_ok=True)
        if not rows.num_rows:
            return 0, 0
    elif stale and existing:
        # It missed a range (its compaction failed): rebuilt from state, which holds this cache's rows as
        # of the range's start; the mark goes once the range is merged too.
        layout = with_declared(Layout(), declared)
        _replace(spark, path, cache, _fresh(_state_rows(lake, cache), layout), fresh_columns=True)
        log.info("lake_table_rebuilt_from_state", cache=cache)
    elif existing and not set(ORDER) <= {c.name for c in schema_info(open_delta(path))}:
        # Compacted by a cdcd that ordered changes by ``_version`` alone: rebuilt once from state (this
        # cache's rows as of the range's start) with the order's columns.
        _replace(spark, path, cache, convert(_state_rows(lake, cache), read_layout(path)))
        log.info("lake_table_order_columns_added", cache=cache)
    if not rows.num_rows:
        if stale:
            (path / STALE_MARK).unlink(missing_ok=True)
        return 0, 0
    stored = read_layout(path) if existing else Layout()
    conv = convert(rows, with_declared(stored, declared))
    had = {c for c, _ in stored.columns.values()}
    conv.added = [c for c, _ in conv.layout.columns.values() if c not in had]
    if conv.key_changed:
        # Keys of another type arrived: the table is rebuilt with JSON-text keys from state (this
        # cache's rows as of the range's start), then the range is merged as usual.
        rebuilt = convert(_state_rows(lake, cache), conv.layout)
        _replace(spark, path, cache, rebuilt, widened=_widenings(stored, rebuilt.layout))
        conv = convert(rows, rebuilt.layout)
        log.info("lake_table_key_to_json", cache=cache)
    elif not existing:
        _create(path, cache, conv.layout)
    elif stored.key_type is None and not stored.key_json:
        # Emptied by a drop in an earlier range, no key seen since: the key column takes these keys' type.
        _replace(spark, path, cache, _fresh(rows.slice(0, 0), conv.layout), fresh_columns=True)
    elif conv.widened or _restorable(path):
        # A column widens (or a table typed before anything widened holds rescued rows): the table is
        # rewritten from state (this cache's rows as of the range's start) typed by the wider layout, so
        # rescued values that fit it now are restored into their columns; then the range is merged.
        rebuilt = _fresh(_state_rows(lake, cache), conv.layout)
        widened = _widenings(stored, rebuilt.layout)
        before = _rescued_rows(path)
        _replace(spark, path, cache, rebuilt, widened=widened, keep_key=True)
        conv = convert(rows, rebuilt.layout)
        conv.added = [c for c, _ in conv.layout.columns.values() if c not in had]
        log.info(
            "lake_table_widened",
            cache=cache,
            columns={c: f"{old} -> {new}" for c, (old, new) in widened.items()},
            rescued_before=before,
            rescued_after=rebuilt.rescued,
        )
    elif conv.added:
        _add_columns(path, conv)
    # Before each table's MERGE: armed at its 2nd hit, it holds compaction with one table committed and
    # the next not begun, where a reader without a cut sees one table ahead of the other.
    failpoints.hit("lake.compact.table_merge")
    _merge(path, conv, app_id, last, file_rows)
    if stale:
        (path / STALE_MARK).unlink(missing_ok=True)
    if conv.rescued:
        metrics.LAKE_RESCUED.labels(cache=cache).inc(conv.rescued)
    if conv.added:
        log.info("lake_table_columns_added", cache=cache, columns=conv.added)
    return conv.rescued, len(conv.added)


def _widenings(stored: Layout, layout: Layout) -> dict[str, tuple[pa.DataType, pa.DataType]]:
    """column -> (type in ``stored``, type in ``layout``) for each column whose type ``layout`` widened."""
    return {
        col: (stored.columns[name][1], t)
        for name, (col, t) in layout.columns.items()
        if name in stored.columns and stored.columns[name][1] != t
    }


def _rescued_rows(path: LakeDir) -> int:
    """Rows of the table whose ``_rescued`` holds something, from the files' statistics."""
    adds = pa.table(open_delta(path).get_add_actions(flatten=True))
    if not adds.num_rows or f"null_count.{RESCUED}" not in adds.column_names:
        return 0
    records = pc.sum(adds.column("num_records")).as_py() or 0
    nulls = pc.sum(adds.column(f"null_count.{RESCUED}")).as_py() or 0
    return int(records - nulls)


def _restorable(path: LakeDir) -> bool:
    """A table typed before anything widened (its key comment names no lattice) with rescued rows: its
    rescued values the lattice takes are restored into their columns, once."""
    key = next((c for c in schema_info(open_delta(path)) if c.name == KEY), None)
    if key is None or key.comment.get("lattice") is not None:
        return False
    return _rescued_rows(path) > 0


def _fresh(rows: pa.Table, layout: Layout) -> Converted:
    """``rows`` typed into ``layout``; no rows: none, the layout as it is (``convert`` would take an empty
    batch's keys for keys of no one type and make the key JSON text)."""
    if rows.num_rows:
        return convert(rows, layout)
    empty = pa.schema([pa.field(OP, pa.string()), *layout.schema()]).empty_table()
    return Converted(empty, layout, [], False, 0)


def missing_tables(lake: LakeDir) -> list[str]:
    """Caches ``state`` holds that have no typed table, or whose table missed a range (marked stale)."""
    scan = scan_tables(lake)
    unreadable = {str(bad.path) for bad in scan.unreadable}
    stale = [c for c, path in scan.found.items() if (path / STALE_MARK).exists()]
    return sorted(
        {c for c in _state_caches(lake) if c not in scan.found and str(table_dir(lake, c)) not in unreadable}
        | set(stale)
    )


# --- state as a source -----------------------------------------------------------------------------------
def _state_caches(lake: LakeDir) -> list[str]:
    state = lake / STATE
    if not is_delta(state):
        return []
    adds = pa.table(open_delta(state).get_add_actions(flatten=True))
    if "partition.cache" not in adds.column_names:
        return []
    return [c for c in adds.column("partition.cache").unique().to_pylist() if c is not None]


def _state_rows(lake: LakeDir, cache: str) -> pa.Table:
    """State's rows of ``cache`` as feed rows (op ``update``)."""
    import pyarrow.dataset as ds

    data = open_delta(lake / STATE).to_pyarrow_dataset()
    rows = data.to_table(filter=ds.field("cache") == cache)
    return rows.append_column("op", pa.array(["update"] * rows.num_rows, pa.string()))


# --- creating and rewriting a table -----------------------------------------------------------------------
def _schema(layout: Layout, since_version: int, keep: Mapping[str, str]) -> pa.Schema:
    """The table's Arrow schema, each column's comment in its field metadata (where Delta keeps it)."""
    comments = {**comments_for(layout, since_version), **keep}
    return pa.schema(
        [
            pa.field(f.name, f.type, True, {"comment": comments[f.name]} if f.name in comments else None)
            for f in layout.schema()
        ]
    )


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField, StructType

    return StructType(
        [
            StructField(
                f.name, from_arrow_type(f.type), True, {k.decode(): v.decode() for k, v in (f.metadata or {}).items()}
            )
            for f in schema
        ]
    )


def _create(path: LakeDir, cache: str, layout: Layout) -> None:
    """An empty table, with delta-rs whatever the engine (no Spark job: a new cache's table answers queries
    sooner); its properties and comments as Spark would write them. A neighbour's creating it first is none."""
    from deltalake import DeltaTable

    from cdcd.lake.storage import as_location_arg

    if isinstance(path, Path):
        path.mkdir(parents=True, exist_ok=True)
    uri, options = as_location_arg(path)
    DeltaTable.create(
        uri,
        _schema(layout, 0, {}),
        mode="ignore",
        description=f"cdcd: current state of cache {cache!r}, one row per live key",
        configuration={**TABLE_PROPERTIES, CACHE_PROPERTY: cache},
        storage_options=options,
        raise_if_key_not_exists=False,
    )


def _replace(
    spark: Any,
    path: LakeDir,
    cache: str,
    conv: Converted,
    *,
    fresh_columns: bool = False,
    widened: Mapping[str, tuple[pa.DataType, pa.DataType]] | None = None,
    keep_key: bool = False,
) -> None:
    """``conv``'s live rows as the table's whole content: a new table (created, then appended), or the
    existing one overwritten with its new schema in one commit (properties and history stay); by Spark, or
    by delta-rs when ``spark`` is None.
    ``fresh_columns``: every column's comment says it appeared now (a new table in the old one's place).
    ``widened``: column -> (type before, type now), each recorded in its column's comment. ``keep_key``: the
    key's comment stays (its type did not change), marked with the lattice."""
    from deltalake import write_deltalake

    from cdcd.lake.storage import as_location_arg

    live = conv.rows.filter(pc.not_equal(conv.rows.column(OP), "delete")).drop_columns([OP])
    uri, options = as_location_arg(path)
    if not is_delta(path):
        _create(path, cache, conv.layout)
        if live.num_rows:
            rows = live.cast(_schema(conv.layout, 0, {}))
            if spark is None:
                write_deltalake(uri, rows, mode="append", storage_options=options)
            else:
                spark.createDataFrame(rows).write.format("delta").mode("append").save(spark_path(path))
        return
    # Columns the table had keep the comment saying when they appeared; the key's says JSON now.
    table = open_delta(path)
    version = int(table.version()) + 1
    infos = schema_info(table)
    keep = {c.name: json.dumps(c.comment, ensure_ascii=False) for c in infos if c.comment}
    for c in infos:
        if c.name in (widened or {}):
            keep[c.name] = widened_comment(c.comment, *(widened or {})[c.name], version)
        if c.name == KEY and keep_key and c.comment:
            keep[KEY] = json.dumps({**c.comment, "lattice": LATTICE}, ensure_ascii=False)
    if not keep_key:
        keep.pop(KEY, None)
    if fresh_columns:
        keep = {}
    schema = _schema(conv.layout, version, keep)
    if spark is None:
        rows = live.cast(conv.layout.schema()).cast(schema)
        write_deltalake(uri, rows, mode="overwrite", schema_mode="overwrite", storage_options=options)
        return
    fields = _spark_schema(schema).fields
    frame = spark.createDataFrame(live.cast(conv.layout.schema()))
    frame = frame.select([frame[quote(f.name)].alias(f.name, metadata=f.metadata) for f in fields])
    frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(spark_path(path))


def _add_columns(path: LakeDir, conv: Converted) -> None:
    """One ``ADD COLUMN`` commit (delta-rs, no Spark job) with each new column's comment."""
    from deltalake import Schema

    table = open_delta(path)
    comments = comments_for(conv.layout, int(table.version()) + 1, conv.added)
    types = {c: t for c, t in conv.layout.columns.values()}
    arrow = pa.schema([pa.field(c, types[c], metadata={"comment": comments[c]}) for c in conv.added])
    table.alter.add_columns(list(Schema.from_arrow(arrow).fields))


def _newer() -> str:
    """The source row's change is later than the target row's: ``ORDER`` compared left to right."""
    expr = f"s.{ORDER[-1]} > t.{ORDER[-1]}"
    for c in reversed(ORDER[:-1]):
        expr = f"(s.{c} > t.{c} OR (s.{c} = t.{c} AND {expr}))"
    return expr


MAX_RANGES = 64
"""Key ranges a MERGE's predicate names at most (more: the source's keys touch most files anyway)."""


def _key_ranges(comps: list[list[Ranged]], at: np.ndarray, keys: pa.ChunkedArray) -> str | None:
    """A predicate on the target's key naming, per clustered component the source's keys fall in, the range of
    those keys (cdcd/lake/maintenance/clustered.py), so delta-rs reads only the files those ranges overlap:
    its own pruning takes the source's one min/max, every file between. Every source key lies in a range,
    so a row any file holds for it still matches. None: no such predicate (keys neither integers nor plain
    strings, a null key, or too many ranges)."""
    if not len(keys) or keys.null_count:
        return None
    integer = pa.types.is_integer(keys.type)
    if not integer and not pa.types.is_string(keys.type):
        return None
    ranges: list[tuple[Any, Any]] = []
    for ci in np.unique(at):
        mm = pc.min_max(keys.take(pa.array(np.flatnonzero(at == ci)))).as_py()
        ranges.append((mm["min"], mm["max"]))
    if len(ranges) > MAX_RANGES:
        return None

    def literal(v: Any) -> str | None:
        if integer:
            return str(int(v))
        if not v.isprintable() or "\\" in v:
            return None
        return "'" + str(v).replace("'", "''") + "'"

    terms = []
    for lo, hi in ranges:
        a, b = literal(lo), literal(hi)
        if a is None or b is None:
            return None
        terms.append(f"(t.{KEY} >= {a} AND t.{KEY} <= {b})")
    return "(" + " OR ".join(terms) + ")"


def _merge(path: LakeDir, conv: Converted, app_id: str, last: int, file_rows: int = FILE_ROWS) -> None:
    """The range's rows into the table with delta-rs (in this process: a Spark MERGE per table would
    cost a few Spark jobs each), carrying the application transaction; the change data feed is
    written by the same commit. Then the files it wrote, unsorted, clustered again by key
    (``clustered.recluster``, a commit of its own changing no data)."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    from cdcd.lake.storage import as_location_arg

    props = CommitProperties(app_transactions=[Transaction(app_id=app_id, version=last)])
    rows = conv.rows
    table = open_delta(path)
    fold_properties(table, path)
    if not table.file_uris():
        # An empty table: a plain append (same transaction), no join.
        live = rows.filter(pc.not_equal(rows.column(OP), "delete")).drop_columns([OP])
        uri, options = as_location_arg(path)
        write_deltalake(uri, live, mode="append", storage_options=options, commit_properties=props)
    else:
        keys = rows.column(KEY)
        if not (pa.types.is_integer(keys.type) or pa.types.is_string(keys.type)):
            _merge_rows(table, rows, props, f"t.{KEY} = s.{KEY}")  # keys of another type: not clustered
            return
        comps = components(ranged_files(pa.table(table.get_add_actions(flatten=True)), KEY))
        at = assign(keys, comps)
        wide = wide_run(comps, at)
        held_rows = sum(f.rows for f in comps[0])
        if wide is None and held_rows > file_rows + file_rows // 2:
            lo, hi = comps[0][0].lo, max((f.hi for f in comps[0]), default=None)
            if pa.types.is_integer(keys.type) and lo is not None and hi is not None:
                # Integer keys: the ranges the file would be cut into, taken as equally wide (no read).
                wide = spread_wide(pa.array(np.linspace(lo, hi, 1024).astype(np.int64)), keys, file_rows, held_rows)
            else:
                schema = pa.schema([pa.schema(table.schema().to_arrow()).field(KEY)])
                held = pa.concat_tables([read_file(path, f.path, schema) for f in comps[0]]).column(KEY)
                wide = spread_wide(held, keys, file_rows)
        ranges = None if wide else _key_ranges(comps, at, keys)
        _merge_rows(table, rows, props, f"t.{KEY} = s.{KEY}" + ("" if ranges is None else f" AND {ranges}"))
        if wide:
            # Its keys spread over most of the table: the MERGE rewrote most of it, cutting that into ranges
            # again would cost a second pass the next such run throws away; a narrower run cuts it.
            return
    recluster(open_delta(path), path, KEY, file_rows)


def _merge_rows(table: Any, rows: pa.Table, props: Any, predicate: str) -> None:
    """delta-rs's MERGE of ``rows`` into ``table`` on ``predicate``: a newer change replaces or deletes the row,
    a new key is inserted unless deleted."""
    (
        table.merge(rows, predicate=predicate, source_alias="s", target_alias="t", commit_properties=props)
        .when_matched_delete(predicate=f"s.{OP} = 'delete' AND {_newer()}")
        .when_matched_update_all(predicate=f"s.{OP} <> 'delete' AND {_newer()}", except_cols=[OP])
        .when_not_matched_insert_all(predicate=f"s.{OP} <> 'delete'", except_cols=[OP])
        .execute()
    )
