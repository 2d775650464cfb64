"""``state`` without a JVM: its creation and one range's MERGE (truncates included) with pyarrow and delta-rs.

delta-rs's own MERGE names a partition's directory ``cache=<percent-escaped name>``, which a cache of
255 characters (or 200 x "é") cannot be; so the MERGE is done here, copy-on-write per data file, and
committed with delta-rs like the lake's other writes: each new file goes into
``cache=<partition_dir_value>`` (cdcd/lake/landing/delta.py), the log holds the real name.

Per cache the range touches: its files are key-range clustered (cdcd/lake/maintenance/clustered.py: sorted
by key, each a bounded range of keys, the range in the file's statistics of ``key``); each winner belongs to
the component of files whose range holds its key, or to the one before it. A component taking no winner is
not read at all; one taking only deletes has its ``key`` column read first (nothing to delete: left as it
is); otherwise its files are read, their rows resolved against the winners (a winner newer by
``ORDER_COLUMNS`` replaces or deletes its row, as Spark's MERGE in ``compact._merge``), the new keys added,
and the component written again sorted by key in files of ``file_rows`` rows (``compact_file_rows``); a
dropped cache's files are removed whole. One commit for the range carries the removes, the adds, the
application transaction and the compaction mark (``userMetadata``): a compaction killed before it left
orphan files only (VACUUM's), one killed after it finds the range done. The files are written by
``prepare_state`` and committed by ``Prepared.commit``: compaction writes them while the typed tables merge,
and commits after those; failing in between, it deletes them (``Prepared.discard``). Copy-on-write (no
deletion vectors): a run costs the files its keys fall in, so keys spread over every range (uniform
changes) still rewrite the partition. Memory: the range's winners (bounded by ``MAX_ROWS_PER_MERGE``) and
one component's rows at a time (a partition written before clustering, or by Spark, is one component the
first time).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import DeltaError
from deltalake.transaction import AddAction, PostCommitHookProperties, RemoveAction

from cdcd.durable import fsync_dir
from cdcd.lake.landing.delta import partition_dir_value
from cdcd.lake.landing.parquet_files import file_stats, write_parquet
from cdcd.lake.maintenance.clustered import (
    FILE_ROWS,
    Ranged,
    assign,
    components,
    ranged_files,
    split_sorted,
    spread_wide,
)
from cdcd.lake.properties import fold_properties
from cdcd.lake.storage import LakeDir, as_location_arg, file_source, is_delta, open_delta
from cdcd.lake.table import ORDER_COLUMNS, PARTITION_BY, STATE, STATE_PROPERTIES, STATE_SCHEMA

log = structlog.get_logger("cdcd.lake")


_DATA_SCHEMA = pa.schema([f for f in STATE_SCHEMA if f.name not in PARTITION_BY])


def ensure_state(lake: LakeDir) -> None:
    """Create ``<lake>/state`` (empty, the contract's schema, partitioning and properties) if absent; a
    neighbour creating it at the same moment is no error."""
    path = lake / STATE
    if is_delta(path):
        return
    if isinstance(path, Path):
        path.mkdir(parents=True, exist_ok=True)
    uri, options = as_location_arg(path)
    try:
        DeltaTable.create(
            uri,
            STATE_SCHEMA,
            mode="error",
            partition_by=list(PARTITION_BY),
            name="cdcd_state",
            description="cdcd state: the latest change of every live key",
            configuration=STATE_PROPERTIES,
            storage_options=options,
            raise_if_key_not_exists=False,
        )
    except (DeltaError, OSError):
        if not is_delta(path):
            raise


@dataclass
class Merged:
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    adds: list[AddAction] = field(default_factory=list)
    removes: list[RemoveAction] = field(default_factory=list)
    written: list[LakeDir] = field(default_factory=list)


def merge_state(
    lake: LakeDir,
    winners: pa.Table,
    truncated: frozenset[str],
    *,
    app_id: str,
    version: int,
    user_metadata: str,
    file_rows: int = FILE_ROWS,
) -> tuple[int, int, int]:
    """Apply one range to ``state`` in one commit carrying ``(app_id, version)`` and ``user_metadata``:
    the rows of the ``truncated`` caches removed, then ``winners`` (latest change per (cache, key),
    deletes included) merged. Returns the rows inserted, updated and deleted."""
    prepared = prepare_state(lake, winners, truncated, file_rows=file_rows)
    return prepared.commit(app_id=app_id, version=version, user_metadata=user_metadata)


@dataclass
class Prepared:
    """One range's new files of ``state``, written but not committed (orphans until ``commit``; ``discard``
    deletes them): lets compaction write them while the typed tables merge, and commit after those."""

    path: LakeDir
    dt: DeltaTable
    out: Merged

    def commit(self, *, app_id: str, version: int, user_metadata: str) -> tuple[int, int, int]:
        """The removes, the adds, the application transaction and the mark in one commit, at the version the
        files were read from plus one (``max_commit_retries=0``). (inserted, updated, deleted)."""
        out = self.out
        now_ms = int(time.time() * 1000)
        try:
            props = CommitProperties(
                max_commit_retries=0,
                app_transactions=[Transaction(app_id, version, now_ms)],
                custom_metadata={"userMetadata": user_metadata},
            )
            dirs = {t.parent for t in out.written if isinstance(t, Path)}
            for d in dirs:
                fsync_dir(d)
            self.dt.create_write_transaction(
                [*out.removes, *out.adds],
                "append",
                self.dt.schema(),
                partition_by=list(PARTITION_BY),
                commit_properties=props,
                post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False),
            )
        except BaseException:
            _discard(self.path, app_id, version, out.written)
            raise
        return out.inserted, out.updated, out.deleted

    def discard(self) -> None:
        """Not to be committed (the compaction failed before ``state``'s turn): its files deleted."""
        for target in self.out.written:
            target.unlink(missing_ok=True)


def prepare_state(
    lake: LakeDir, winners: pa.Table, truncated: frozenset[str], *, file_rows: int = FILE_ROWS
) -> Prepared:
    """Read ``state`` at its current version and write the files one range's MERGE adds (the ``truncated``
    caches' files removed, ``winners`` resolved against the files holding their keys), without committing."""
    path = lake / STATE
    dt = open_delta(path)
    fold_properties(dt, path)
    adds = pa.table(dt.get_add_actions(flatten=True))
    now_ms = int(time.time() * 1000)
    out = Merged()
    caches = set(winners.column("cache").unique().to_pylist()) if winners.num_rows else set()
    try:
        for cache in sorted(caches | truncated):
            files = _files_of(adds, cache)
            if cache in truncated:
                out.deleted += sum(f.rows for f in files)
                out.removes += [RemoveAction(f.path, True, now_ms, f.size, {"cache": cache}) for f in files]
                files = []
            rows = winners.filter(pc.equal(winners.column("cache"), cache)) if cache in caches else None
            if rows is not None and rows.num_rows:
                _merge_partition(path, cache, files, rows.combine_chunks(), now_ms=now_ms, out=out, file_rows=file_rows)
    except BaseException:
        Prepared(path, dt, out).discard()
        raise
    return Prepared(path, dt, out)


def _discard(path: LakeDir, app_id: str, version: int, written: list[LakeDir]) -> None:
    """A commit that failed: its files deleted unless the log says it is in (failing after its commit
    point); an error reading the log keeps them (orphans for VACUUM at worst)."""
    try:
        if (open_delta(path).transaction_version(app_id) or -1) >= version:
            return
    except Exception:  # the log unreadable now: keep the files, they may be committed
        log.debug("lake_state_merge_unknown", path=str(path), exc_info=True)
        return
    for target in written:
        target.unlink(missing_ok=True)


def _files_of(adds: pa.Table, cache: str) -> list[Ranged]:
    """Each live file of the cache's partition, with its key range."""
    if not adds.num_rows:
        return []
    return ranged_files(adds.filter(pc.equal(adds.column("partition.cache"), cache)), "key")


def _read(root: LakeDir, rel: str, columns: list[str] | None = None) -> pa.Table:
    """A state file's data columns (``columns``: these only), typed as the contract says; a column the
    file lacks is null."""
    pf = pq.ParquetFile(file_source(root / unquote(rel)))
    have = set(pf.schema_arrow.names)
    schema = _DATA_SCHEMA if columns is None else pa.schema([_DATA_SCHEMA.field(c) for c in columns])
    data = pf.read(columns=[n for n in schema.names if n in have])
    for f in schema:
        if f.name not in have:
            data = data.append_column(f, pa.nulls(data.num_rows, f.type))
    return data.select(schema.names).cast(schema)


def _newer(source: pa.Table, target: pa.Table) -> np.ndarray:
    """Row by row, whether ``source``'s change is later than ``target``'s (``ORDER_COLUMNS`` compared left
    to right; a null is lower than any value, as in Spark's struct comparison)."""
    newer = np.zeros(source.num_rows, bool)
    equal = np.ones(source.num_rows, bool)
    low = np.iinfo(np.int64).min
    for c in ORDER_COLUMNS:
        s = source.column(c).cast(pa.int64()).fill_null(low).to_numpy()
        t = target.column(c).cast(pa.int64()).fill_null(low).to_numpy()
        newer |= equal & (s > t)
        equal &= s == t
    return newer


def _merge_partition(
    root: LakeDir, cache: str, files: list[Ranged], rows: pa.Table, *, now_ms: int, out: Merged, file_rows: int
) -> None:
    """One cache's winners into its files, component by component (cdcd/lake/maintenance/clustered.py): a
    component none of whose files holds a changed key and that takes no new key is neither read nor
    written."""
    comps = components(files)
    at = assign(rows.column("key"), comps)
    for ci in np.unique(at):
        sub = rows.take(np.flatnonzero(at == ci))
        comp = comps[int(ci)] if comps else []
        _merge_component(root, cache, comp, sub, now_ms=now_ms, out=out, file_rows=file_rows, one=len(comps) <= 1)


def _merge_component(
    root: LakeDir,
    cache: str,
    comp: list[Ranged],
    rows: pa.Table,
    *,
    now_ms: int,
    out: Merged,
    file_rows: int,
    one: bool,
) -> None:
    keys = rows.column("key")
    others = [n for n in _DATA_SCHEMA.names if n != "key"]
    deletes_only = bool(pc.all(pc.equal(rows.column("op"), "delete")).as_py())
    targets: list[pa.Table] = []
    for f in comp:
        # Only deletes: the key column alone decides whether a file holds one of them; anything else
        # (an update or a new key) rewrites the component, which is then read whole.
        target_keys = _read(root, f.path, ["key"]).column("key")
        if deletes_only and not pc.any(pc.is_in(target_keys, value_set=keys)).as_py():
            targets.append(pa.table({}))
            continue
        targets.append(_read(root, f.path, others).add_column(_DATA_SCHEMA.get_field_index("key"), "key", target_keys))
    if deletes_only and all(t.num_columns == 0 for t in targets):
        return  # deletes of keys no file holds: nothing changes
    for i, f in enumerate(comp):
        if targets[i].num_columns == 0:
            targets[i] = _read(root, f.path)
    target = pa.concat_tables(targets) if targets else _DATA_SCHEMA.empty_table()
    at = pc.index_in(target.column("key"), value_set=keys)
    hit = pc.is_valid(at).to_numpy(zero_copy_only=False)
    idx = at.filter(pa.array(hit)).to_numpy(zero_copy_only=False)
    matched = np.zeros(rows.num_rows, bool)
    matched[idx] = True
    source = rows.take(idx)
    held_rows = target.filter(pa.array(hit))
    newer = _newer(source, held_rows)
    deletes = newer & (source.column("op").to_numpy(zero_copy_only=False) == "delete")
    updates = newer & ~deletes
    out.deleted += int(deletes.sum())
    out.updated += int(updates.sum())
    new = rows.filter(pa.array(~matched))
    new = new.filter(pc.not_equal(new.column("op"), "delete"))
    out.inserted += new.num_rows
    if not (deletes.any() or updates.any() or new.num_rows):
        return  # every change older than its row: the files stay as they are
    parts = [
        target.filter(pa.array(~hit)),
        held_rows.filter(pa.array(~newer)),
        source.filter(pa.array(updates)).select(_DATA_SCHEMA.names).cast(_DATA_SCHEMA),
        new.select(_DATA_SCHEMA.names).cast(_DATA_SCHEMA),
    ]
    out.removes += [RemoveAction(f.path, True, now_ms, f.size, {"cache": cache}) for f in comp]
    data = pa.concat_tables(parts)
    # The partition one component (written by Spark or before this layout, or left so by such a run) and this
    # run's keys spread over most of it: it stays one file. Cutting it into ranges costs a sort, and the next
    # such run rewrites them all again; a run of narrower keys cuts it.
    if one and comp and data.num_rows > file_rows + file_rows // 2 and spread_wide(data.column("key"), keys, file_rows):
        _write(root, cache, data, now_ms, out)
        return
    for part in split_sorted(data, "key", file_rows):
        _write(root, cache, part, now_ms, out)


def _write(root: LakeDir, cache: str, data: pa.Table, now_ms: int, out: Merged) -> None:
    rel_dir = f"cache={partition_dir_value(cache)}"
    rel = f"{rel_dir}/part-{uuid.uuid4().hex}.c000.zstd.parquet"
    target = root / rel
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
    out.written.append(target)
    size, _ = write_parquet(data, target)
    out.adds.append(AddAction(rel, size, {"cache": cache}, now_ms, True, _stats(data)))


def _stats(data: pa.Table) -> str:
    """The change columns' statistics plus the key's bounds (exact): the file's key range."""
    stats = json.loads(file_stats(data))
    if data.num_rows and data.column("key").null_count == 0:
        mm = pc.min_max(data.column("key")).as_py()
        stats["minValues"]["key"], stats["maxValues"]["key"] = mm["min"], mm["max"]
        stats["nullCount"]["key"] = 0
    return json.dumps(stats)
