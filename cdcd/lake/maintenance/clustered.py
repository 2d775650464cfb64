"""Key-range clustered files: ``state``'s cache partitions and the typed tables as files sorted by key, each
holding one bounded range of keys, so a compaction reads and rewrites only the files whose range its changed
keys fall in (docs/lake.md, "Key-range clustered files").

A file's range is its Delta statistics' ``minValues`` / ``maxValues`` of the key column (bounds, as data
skipping needs them to be: Spark's truncated string maximum gets a tie-breaker appended, delta-rs and cdcd
keep whole values). Files whose ranges
overlap form one *component* (a file without bounds overlaps everything): a changed key belongs to the
component whose range holds it, or, between components, to the one before it (the first, before all), so a
key held by any file is always found in the component it is assigned to. A touched component is read whole
and written again as one file up to half again ``file_rows`` rows, else sorted by key and cut into files of
``file_rows`` rows: an oversized file splits, and the touched part of the table ends as disjoint ranges again
(a table written by Spark or by an older cdcd, overlapping, heals as compaction touches it). A typed table's
MERGE output is merged into the table's main sorted run by ``recluster``; a run whose keys spread over most
of a table is left as written (``spread_wide``, ``wide_run``: cutting it costs a pass the next such run
throws away). Files with pairwise disjoint ranges make one *sorted run*
(Paimon's term): the small-file bound counts a sorted run as one (``autocompact.bound_compacted``).
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import DeltaError
from deltalake.transaction import AddAction, PostCommitHookProperties, RemoveAction

from cdcd import failpoints
from cdcd.durable import fsync_dir, fsync_file
from cdcd.lake.storage import LakeDir, file_source
from cdcd.logging import describe

log = structlog.get_logger("cdcd.lake")

RECLUSTER_WRITTEN = "lake.recluster.written"
"""Fail point: a typed table's clustered files are written and fsynced, not yet committed."""

FILE_ROWS = 65_536
"""Rows per clustered file by default (``compact_file_rows``): a compaction rewrites whole files, so the
smaller they are the closer its cost tracks the changed keys; the more files, the more a reader opens."""


@dataclass(frozen=True)
class Ranged:
    """One live file and its key range (``lo`` / ``hi`` None: unknown, below / above every key)."""

    path: str
    size: int
    rows: int
    lo: Any
    hi: Any


def ranged_files(adds: pa.Table, key: str) -> list[Ranged]:
    """The files of ``adds`` (rows of ``get_add_actions(flatten=True)``) with their ranges of ``key``."""
    if not adds.num_rows:
        return []
    n = adds.num_rows
    los = adds.column(f"min.{key}").to_pylist() if f"min.{key}" in adds.column_names else [None] * n
    his = adds.column(f"max.{key}").to_pylist() if f"max.{key}" in adds.column_names else [None] * n
    out = []
    for path, size, rows, lo, hi in zip(
        adds.column("path").to_pylist(),
        adds.column("size_bytes").to_pylist(),
        adds.column("num_records").to_pylist(),
        los,
        his,
        strict=True,
    ):
        known = lo is not None and hi is not None
        out.append(Ranged(path, int(size), int(rows or 0), lo if known else None, hi if known else None))
    return out


def components(files: Sequence[Ranged]) -> list[list[Ranged]]:
    """Files grouped by overlapping ranges, in key order (a file without a range: one group with every file
    from the first on, so it is always read with whatever it may hold)."""
    if not files:
        return []
    if any(f.lo is None for f in files):
        return [list(files)]
    ordered = sorted(files, key=lambda f: f.lo)
    out: list[list[Ranged]] = [[ordered[0]]]
    hi = ordered[0].hi
    for f in ordered[1:]:
        if f.lo <= hi:
            out[-1].append(f)
            hi = max(hi, f.hi)
        else:
            out.append([f])
            hi = f.hi
    return out


def sorted_runs(files: Sequence[Ranged]) -> list[list[Ranged]]:
    """Files as sorted runs: each run's files pairwise disjoint, in key order (greedy, first fit by lowest
    key: as few runs as the deepest overlap); a file without a range is a run of its own."""
    runs: list[list[Ranged]] = []
    for f in sorted((f for f in files if f.lo is not None), key=lambda f: f.lo):
        for run in runs:
            if run[-1].hi < f.lo:
                run.append(f)
                break
        else:
            runs.append([f])
    return runs + [[f] for f in files if f.lo is None]


def assign(keys: pa.Array | pa.ChunkedArray, comps: Sequence[Sequence[Ranged]]) -> np.ndarray:
    """For each key, the index of the component it belongs to (the one whose range holds it, else the one
    before it, the first for keys before every range)."""
    if len(comps) <= 1:
        return np.zeros(len(keys), np.int64)
    los = [min(f.lo for f in c) for c in comps]
    out = np.zeros(len(keys), np.int64)
    valid = pc.is_valid(keys).to_numpy(zero_copy_only=False)  # a null key (none in practice): the first
    present = keys.filter(pa.array(valid)) if not valid.all() else keys
    if pa.types.is_integer(keys.type):
        values: np.ndarray = np.asarray(present.to_numpy(), np.int64)
        bounds = np.array(los, np.int64)
    else:
        values = np.array(present.to_pylist(), dtype=object)
        bounds = np.array(los, dtype=object)
    at = np.searchsorted(bounds, values, side="right") - 1
    out[valid] = np.clip(at, 0, len(comps) - 1)
    return out


SPREAD_SAMPLE = 4096
"""Keys sampled (each side) to tell whether a run's changed keys spread over most of a table's key ranges."""


def spread_wide(
    target_keys: pa.Array | pa.ChunkedArray,
    source_keys: pa.Array | pa.ChunkedArray,
    file_rows: int,
    target_rows: int | None = None,
) -> bool:
    """Whether ``source_keys`` fall in more than half of the files ``target_keys`` (or a sample of them standing
    for ``target_rows`` rows) would be cut into (sorted, in files of ``file_rows`` rows), estimated from samples.
    Such a run rewrites most of the table whatever its layout: sorting it into ranges costs a second pass and
    saves the next such run nothing."""
    bins = -(-(len(target_keys) if target_rows is None else target_rows) // max(1, file_rows))
    if bins < 2 or not len(source_keys):
        return False
    rng = np.random.default_rng(43)

    def sample(keys: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
        keys = keys.drop_null()
        if len(keys) > SPREAD_SAMPLE:
            keys = keys.take(pa.array(rng.choice(len(keys), SPREAD_SAMPLE, replace=False)))
        return keys

    target = sample(target_keys)
    target = target.take(pc.sort_indices(target))
    if not len(target):
        return False
    cuts = [target[int(len(target) * i / bins)].as_py() for i in range(1, bins)]
    source = sample(source_keys).to_pylist()
    at = np.searchsorted(np.array(cuts, dtype=object), np.array(source, dtype=object), side="right")
    return 2 * len(np.unique(at)) > bins


def wide_run(comps: Sequence[Sequence[Ranged]], at: np.ndarray) -> bool | None:
    """From the layout alone: whether the keys assigned (``at``) touch more than half of several components
    (clustered files); None: one component, the layout cannot tell (``spread_wide`` on its keys can)."""
    if len(comps) < 2:
        return None
    return 2 * len(np.unique(at)) > len(comps)


def split_sorted(data: pa.Table, key: str, file_rows: int) -> list[pa.Table]:
    """``data`` as one file up to half again ``file_rows`` rows, else sorted by ``key`` and cut into equal files
    of at most ``file_rows`` rows (none: no rows)."""
    if not data.num_rows:
        return []
    # Up to half again as many rows stay one file: a full file taking a key or two does not halve. Its rows'
    # order within it does not matter (a file's range is what readers and compaction skip by): unsorted.
    if data.num_rows <= file_rows + file_rows // 2:
        return [data]
    parts = -(-data.num_rows // max(1, file_rows))
    data = data.take(pc.sort_indices(data, sort_keys=[(key, "ascending")]))
    step = -(-data.num_rows // parts)
    return [data.slice(start, step) for start in range(0, data.num_rows, step)]


def _json_value(v: Any) -> Any:
    if isinstance(v, datetime.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(datetime.UTC).replace(tzinfo=None)
        return v.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    if isinstance(v, datetime.date):
        return v.isoformat()
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


def full_stats(data: pa.Table) -> str:
    """Delta statistics of every scalar column (as delta-rs writes them: bounds unless all null, a null count
    always; nested columns left out), so a rewritten file keeps what readers skip by and ``lake show``
    counts rescued rows from."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in data.column_names:
        col = data.column(name)
        t = col.type
        scalar = (
            pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_boolean(t)
            or pa.types.is_date(t)
            or pa.types.is_timestamp(t)
        )
        if not scalar:
            continue
        nulls[name] = col.null_count
        if col.null_count < data.num_rows:
            mm = pc.min_max(col).as_py()
            lo, hi = _json_value(mm["min"]), _json_value(mm["max"])
            if lo is not None and hi is not None:
                mins[name], maxs[name] = lo, hi
    return json.dumps({"numRecords": data.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def write_file(root: LakeDir, rel_dir: str, data: pa.Table, stats: str | None = None) -> tuple[str, int, str]:
    """One sorted file ``<rel_dir>/part-<uuid>.c000.zstd.parquet`` under ``root``, fsynced when local:
    (relative path, size, statistics)."""
    name = f"part-{uuid.uuid4().hex}.c000.zstd.parquet"
    rel = f"{rel_dir}/{name}" if rel_dir else name
    target = root / rel
    stats = full_stats(data) if stats is None else stats
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, str(target), compression="zstd", row_group_size=1 << 20)
        fsync_file(target)
        return rel, target.stat().st_size, stats
    pq.write_table(data, target.fs_path, filesystem=target.fs, compression="zstd", row_group_size=1 << 20)
    return rel, int(target.size()), stats


def read_file(root: LakeDir, rel: str, schema: pa.Schema) -> pa.Table:
    """One data file's rows in ``schema`` (a column the file lacks, added to the table later, is null)."""
    pf = pq.ParquetFile(file_source(root / unquote(rel)))
    have = set(pf.schema_arrow.names)
    data = pf.read(columns=[n for n in schema.names if n in have])
    for f in schema:
        if f.name not in have:
            data = data.append_column(f, pa.nulls(data.num_rows, f.type))
    return data.select(schema.names).cast(schema)


def needs_recluster(comp: Sequence[Ranged], file_rows: int) -> bool:
    """A component of overlapping files, or one file grown past half again ``file_rows``: to be written again
    sorted and split."""
    return len(comp) > 1 or comp[0].rows > file_rows + file_rows // 2


def _into_main_run(
    root: LakeDir, comp: Sequence[Ranged], key: str, file_rows: int, schema: pa.Schema
) -> list[tuple[list[Ranged], pa.Table]]:
    """A component's files merged into its longest sorted run of files not oversized (its *main* run): the
    other files' rows, sorted, go each into the main-run file whose range holds them, or, between two of
    them, into a new file of that gap. Returns (files replaced, their rows and the rows they take) per main-run
    file that takes rows, and ((), rows) per gap: what is written again, the rest of the main run left as it
    is. So a MERGE's unsorted output spanning two ranges of keys does not rewrite every file between them."""
    fit = [f for f in comp if f.lo is not None and f.rows <= file_rows + file_rows // 2]
    runs = sorted_runs(fit)
    main = max(runs, key=len) if runs else []
    in_main = {f.path for f in main}
    others = [f for f in comp if f.path not in in_main]
    rows = pa.concat_tables([read_file(root, f.path, schema) for f in others])
    if not main or not rows.num_rows:
        return [(others, rows)]
    keys = rows.column(key)
    values = keys.to_pylist()
    at = assign(keys, [[f] for f in main]).tolist()
    # Slot 2i+1: in main[i]'s range; 2i+2: the gap after it (0: before the first).
    slots: dict[int, list[int]] = {}
    for j, i in enumerate(at):
        slot = 0 if values[j] < main[i].lo else (2 * i + 1 if values[j] <= main[i].hi else 2 * i + 2)
        slots.setdefault(slot, []).append(j)
    # A gap's few rows (under half a file) go into the file before it (the first, before all): keys landing
    # beyond the last file, as increasing ids do, grow it rather than add a small file per compaction.
    merged: dict[int, list[int]] = {}
    for slot, idx in slots.items():
        into = max(1, slot - 1) if slot % 2 == 0 and len(idx) < file_rows // 2 else slot
        merged.setdefault(into, []).extend(idx)
    out: list[tuple[list[Ranged], pa.Table]] = []
    replaced = list(others)
    for slot, idx in sorted(merged.items()):
        taken = rows.take(pa.array(idx, pa.int64()))
        if slot % 2:  # main[i] is written again with them
            f = main[(slot - 1) // 2]
            out.append(([*replaced, f], pa.concat_tables([read_file(root, f.path, schema), taken])))
        else:
            out.append((replaced, taken))
        replaced = []
    return out


def recluster(dt: DeltaTable, root: LakeDir, key: str, file_rows: int) -> tuple[int, int]:
    """An unpartitioned table's components that ``needs_recluster`` written again sorted
    by ``key`` in files of at most ``file_rows`` rows, in one commit of ``dataChange = false`` actions (as
    OPTIMIZE's: readers and the change data feed see the same rows) at the version ``dt`` holds plus one.
    (files removed, files added); (0, 0): nothing to do, or the commit lost to another writer's (its files
    deleted: the next compaction tries again)."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    comps = components(ranged_files(adds, key))
    todo = [c for c in comps if needs_recluster(c, file_rows)]
    if not todo:
        return 0, 0
    schema = pa.schema(dt.schema().to_arrow())
    now_ms = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = []
    written: list[LakeDir] = []
    removed = 0
    read_version = dt.version()
    attempt = uuid.uuid4().hex
    try:
        for comp in todo:
            for files, data in _into_main_run(root, comp, key, file_rows, schema):
                for part in split_sorted(data, key, file_rows):
                    rel, size, stats = write_file(root, "", part)
                    written.append(root / rel)
                    actions.append(AddAction(rel, size, {}, now_ms, False, stats))
                actions += [RemoveAction(f.path, False, now_ms, f.size, {}) for f in files]
                removed += len(files)
        if isinstance(root, Path):
            fsync_dir(root)
        failpoints.hit(RECLUSTER_WRITTEN)
        tag = {"files_removed": removed, "files_added": len(written), "clustered": key, "attempt": attempt}
        info = {"autocompact": tag}
        dt.create_write_transaction(
            actions,
            "append",
            dt.schema(),
            commit_properties=CommitProperties(max_commit_retries=0, custom_metadata={"cdcd": json.dumps(info)}),
            post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False),
        )
    except DeltaError as exc:
        if _committed(dt, attempt, read_version):  # failed after its commit point (writing the checkpoint)
            log.warning("lake_recluster_error_after_commit", table=str(root), error=describe(exc))
            return removed, len(written)
        # Another writer's commit came first: the files go, the next compaction tries again.
        for target in written:
            target.unlink(missing_ok=True)
        log.info("lake_recluster_lost", table=str(root), error=describe(exc))
        return 0, 0
    except BaseException:
        if not _committed(dt, attempt, read_version):
            for target in written:
                target.unlink(missing_ok=True)
        raise
    return removed, len(written)


def _committed(dt: DeltaTable, attempt: str, read_version: int) -> bool:
    """Whether a commit after ``read_version`` is the recluster ``attempt`` (an error reading the log counts as
    committed: its files are then kept, orphans at worst)."""
    try:
        dt.update_incremental()
        for entry in dt.history(max(1, dt.version() - read_version)):
            if entry.get("version", -1) <= read_version:
                continue
            meta = json.loads(entry.get("cdcd", "{}"))
            if isinstance(meta, dict) and meta.get("autocompact", {}).get("attempt") == attempt:
                return True
        return False
    except (DeltaError, OSError, ValueError):
        return True
