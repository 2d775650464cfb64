"""The Parquet data files of the change table: how each is written (codec and dictionaries by size,
fsynced when local) and its Delta statistics (``numRecords``, min/max and null counts of the
columns readers skip files by)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdcd.durable import fsync_file
from cdcd.lake.storage import LakeDir, ObjectPath

_STAT_COLUMNS = (
    "partition",
    "version_order",
    "version_cluster_id",
    "node_order",
    "topology_version",
    "wal_segment",
    "wal_offset",
    "wal_index",
    "expire_time_ms",
    "source_generation",
)
"""Columns whose min/max go into each file's Delta statistics (readers skip files by them)."""


def _stat_value(v: Any) -> Any:
    return v.as_py() if isinstance(v, pa.Scalar) else v


def file_stats(table: pa.Table) -> str:
    """Delta statistics (``numRecords``, ``minValues``, ``maxValues``, ``nullCount``) of one file's rows."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in table.column_names:
        col = table.column(name)
        # A column with a null count but no bounds makes delta-rs's reader skip every file:
        # either all three, or none.
        if name in _STAT_COLUMNS and table.num_rows and col.null_count == 0:
            mm = pc.min_max(col)
            mins[name] = _stat_value(mm["min"])
            maxs[name] = _stat_value(mm["max"])
            nulls[name] = 0
    return json.dumps({"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})


def slice_stats(data: pa.Table, slices: list[tuple[int, int]]) -> list[str]:
    """``file_stats`` of each ``data[start:end]``, computed for all slices at once (a batch over
    many caches is many tiny files: per-file compute calls would cost more than writing them)."""
    if not slices:
        return []
    starts = np.array([lo for lo, _ in slices], np.int64)
    columns: list[tuple[str, list[Any], list[Any]]] = []
    for name in data.column_names:
        col = data.column(name)
        if name not in _STAT_COLUMNS:
            continue
        if col.null_count:  # rare: per slice, nulls exclude the column's statistics
            return [file_stats(data.slice(lo, hi - lo)) for lo, hi in slices]
        arr = col.to_numpy()
        columns.append((name, np.minimum.reduceat(arr, starts).tolist(), np.maximum.reduceat(arr, starts).tolist()))
    out = []
    for i, (lo, hi) in enumerate(slices):
        mins = {name: lo_values[i] for name, lo_values, _ in columns}
        maxs = {name: hi_values[i] for name, _, hi_values in columns}
        nulls = {name: 0 for name, _, _ in columns}
        out.append(json.dumps({"numRecords": hi - lo, "minValues": mins, "maxValues": maxs, "nullCount": nulls}))
    return out


SMALL_FILE_ROWS = 1024
"""Files of fewer rows (one per cache and commit when a batch spans many caches) are written with
snappy and no dictionaries: zstd's and the dictionaries' set-up per column cost more than the whole
file, and OPTIMIZE rewrites such files anyway."""


def parquet_codec(chunk: pa.Table) -> str:
    """The compression ``_parquet_options`` chooses, for the file's name."""
    return str(_parquet_options(chunk)["compression"])


_NO_DICTIONARY = frozenset({"key", "value", "version_order", "partition", "wal_index"})
"""Columns whose values hardly repeat within a run of rows (keys, values, the version order that grows
per entry, the hash partition and the entry's index in its record): a dictionary costs a hash per value
and pyarrow either gives up on it or keeps one as large as the column, so the write is slower and the
file larger than plain values under zstd. The other columns repeat per record, per cache or per node."""


def _parquet_options(chunk: pa.Table) -> dict[str, Any]:
    if chunk.num_rows < SMALL_FILE_ROWS:
        return {"compression": "snappy", "use_dictionary": False}
    dictionary = [c for c in chunk.column_names if c not in _NO_DICTIONARY]
    return {"compression": "zstd", "row_group_size": 1 << 20, "use_dictionary": dictionary}


def write_parquet(chunk: pa.Table, full: LakeDir, *, fsync: bool = True) -> tuple[int, int]:
    """Write one data file (fsynced when local and ``fsync``); (size in bytes, modification time in ms)."""
    if isinstance(full, ObjectPath):
        pq.write_table(chunk, full.fs_path, filesystem=full.fs, **_parquet_options(chunk))
        return full.size(), int(time.time() * 1000)
    pq.write_table(chunk, full, **_parquet_options(chunk))
    if fsync:
        fsync_file(full)
    st = full.stat()
    return st.st_size, st.st_mtime_ns // 10**6
