"""``state`` without a JVM: its creation and one range's MERGE (truncates included) with pyarrow and delta-rs.

delta-rs's own MERGE names a partition's directory ``cache=<percent-escaped name>``, which a cache of
255 characters (or 200 x "é") cannot be; so the MERGE is done here, copy-on-write per data file, and
committed with delta-rs like the lake's other writes: each new file goes into
``cache=<partition_dir_value>`` (cdcd/lake/landing/delta.py), the log holds the real name.

Per cache the range touches: its files have their ``key`` column read (not pruned by key statistics: a
writer's truncated string bounds would make a skipped file's key a second row), looked up among the
winners' keys in one hash lookup each; those that do hold a winner's key have their other columns read
(the keys not a second time), their rows resolved against the
winners (a winner newer by ``ORDER_COLUMNS`` replaces or deletes its row, as Spark's MERGE in
``compact._merge``), and written again with the winners no file held; a dropped cache's files are
removed whole. One commit for the range carries the removes, the adds, the application transaction and
the compaction mark (``userMetadata``): a compaction killed before it left orphan files only (VACUUM's),
one killed after it finds the range done. The files are written by ``prepare_state`` and committed by
``Prepared.commit``: compaction writes them while the typed tables merge, and commits after those;
failing in between, it deletes them (``Prepared.discard``). Every file holding a changed key is read
and written whole (copy-on-write, no deletion vectors): with changes spread over all keys, each run
rewrites the whole partition. Memory: the range's winners (bounded by ``MAX_ROWS_PER_MERGE``)
and up to ``FILE_ROWS`` rows of one partition at a time.
"""

from __future__ import annotations

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
from cdcd.lake.storage import LakeDir, as_location_arg, file_source, is_delta, open_delta
from cdcd.lake.table import ORDER_COLUMNS, PARTITION_BY, STATE, STATE_PROPERTIES, STATE_SCHEMA

log = structlog.get_logger("cdcd.lake")

FILE_ROWS = 1 << 20
"""Rows of one partition held before they are written out as a file of their own."""

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
    lake: LakeDir, winners: pa.Table, truncated: frozenset[str], *, app_id: str, version: int, user_metadata: str
) -> tuple[int, int, int]:
    """Apply one range to ``state`` in one commit carrying ``(app_id, version)`` and ``user_metadata``:
    the rows of the ``truncated`` caches removed, then ``winners`` (latest change per (cache, key),
    deletes included) merged. Returns the rows inserted, updated and deleted."""
    return prepare_state(lake, winners, truncated).commit(app_id=app_id, version=version, user_metadata=user_metadata)


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


def prepare_state(lake: LakeDir, winners: pa.Table, truncated: frozenset[str]) -> Prepared:
    """Read ``state`` at its current version and write the files one range's MERGE adds (the ``truncated``
    caches' files removed, ``winners`` resolved against the files holding their keys), without committing."""
    path = lake / STATE
    dt = open_delta(path)
    adds = pa.table(dt.get_add_actions(flatten=True))
    now_ms = int(time.time() * 1000)
    out = Merged()
    caches = set(winners.column("cache").unique().to_pylist()) if winners.num_rows else set()
    try:
        for cache in sorted(caches | truncated):
            files = _files_of(adds, cache)
            if cache in truncated:
                out.deleted += sum(n for _, _, n in files)
                out.removes += [RemoveAction(p, True, now_ms, size, {"cache": cache}) for p, size, _ in files]
                files = []
            rows = winners.filter(pc.equal(winners.column("cache"), cache)) if cache in caches else None
            if rows is not None and rows.num_rows:
                _merge_partition(path, cache, files, rows.combine_chunks(), now_ms=now_ms, out=out)
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


def _files_of(adds: pa.Table, cache: str) -> list[tuple[str, int, int]]:
    """(path, size, rows) of each live file of the cache's partition."""
    if not adds.num_rows:
        return []
    part = adds.filter(pc.equal(adds.column("partition.cache"), cache))
    return list(
        zip(
            part.column("path").to_pylist(),
            [int(s) for s in part.column("size_bytes").to_pylist()],
            [int(n or 0) for n in part.column("num_records").to_pylist()],
            strict=True,
        )
    )


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
    root: LakeDir, cache: str, files: list[tuple[str, int, int]], rows: pa.Table, *, now_ms: int, out: Merged
) -> None:
    keys = rows.column("key")
    matched = np.zeros(rows.num_rows, bool)
    pending: list[pa.Table] = []
    held = 0
    others = [n for n in _DATA_SCHEMA.names if n != "key"]
    for rel, size, _ in files:
        # The key column alone decides whether the file is touched (one hash lookup per key); the other
        # columns are read only for a touched file, its keys not a second time.
        target_keys = _read(root, rel, ["key"]).column("key")
        at = pc.index_in(target_keys, value_set=keys)
        if at.null_count == len(at):
            continue
        target = _read(root, rel, others).add_column(_DATA_SCHEMA.get_field_index("key"), "key", target_keys)
        hit = pc.is_valid(at).to_numpy(zero_copy_only=False)
        idx = at.filter(pa.array(hit)).to_numpy(zero_copy_only=False)
        source = rows.take(idx)
        matched[idx] = True
        held_rows = target.filter(pa.array(hit))
        newer = _newer(source, held_rows)
        deletes = newer & (source.column("op").to_numpy(zero_copy_only=False) == "delete")
        updates = newer & ~deletes
        out.deleted += int(deletes.sum())
        out.updated += int(updates.sum())
        keep = target.filter(pa.array(~hit))
        kept_old = held_rows.filter(pa.array(~newer))
        replaced = source.filter(pa.array(updates)).select(_DATA_SCHEMA.names).cast(_DATA_SCHEMA)
        for part in (keep, kept_old, replaced):
            if part.num_rows:
                pending.append(part)
                held += part.num_rows
        out.removes.append(RemoveAction(rel, True, now_ms, size, {"cache": cache}))
        if held >= FILE_ROWS:
            _write(root, cache, pending, now_ms, out)
            pending, held = [], 0
    new = rows.filter(pa.array(~matched))
    new = new.filter(pc.not_equal(new.column("op"), "delete"))
    out.inserted += new.num_rows
    if new.num_rows:
        pending.append(new.select(_DATA_SCHEMA.names).cast(_DATA_SCHEMA))
    if pending:
        _write(root, cache, pending, now_ms, out)


def _write(root: LakeDir, cache: str, parts: list[pa.Table], now_ms: int, out: Merged) -> None:
    data = pa.concat_tables(parts)
    rel_dir = f"cache={partition_dir_value(cache)}"
    rel = f"{rel_dir}/part-{uuid.uuid4().hex}.c000.zstd.parquet"
    target = root / rel
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
    out.written.append(target)
    size, _ = write_parquet(data, target)
    out.adds.append(AddAction(rel, size, {"cache": cache}, now_ms, True, file_stats(data)))
