"""The change data feed of ``<lake>/changes``: the rows a range of its versions added, for compaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.lake.deltalog import DeltaLogError, read_commit
from cdcd.lake.storage import LakeDir, ObjectPath, file_source
from cdcd.lake.table import CHANGE_SCHEMA, PARTITION_BY, STATE_SCHEMA

STATE_COLUMNS = tuple(STATE_SCHEMA.names)

FEED_COLUMNS = ("op", *STATE_COLUMNS)
_FEED_READ = (*FEED_COLUMNS, "source_generation")
"""What ``read_feed`` returns: the feed and the generation (which orders one source's rows with
``wal_*``; ``split_truncates`` needs it and drops it)."""


def read_feed(changes: LakeDir, start: int, end: int) -> pa.Table:
    """The change data feed of versions ``start..end``: on this append-only table, exactly the rows
    of the files those commits added. Read straight from the log and the files with pyarrow: live
    traffic leaves one small file per cache per commit, which this opens far faster than a Spark
    file scan (and delta-rs's ``load_cdf`` misreads partition directories it had to escape)."""
    from concurrent.futures import ThreadPoolExecutor

    schema = pa.schema([CHANGE_SCHEMA.field(name) for name in _FEED_READ])
    data_columns = [name for name in _FEED_READ if name not in PARTITION_BY]
    files = _feed_files(changes, start, end)
    data_schema = pa.schema([schema.field(name) for name in data_columns])

    def read(item: tuple[LakeDir, dict[str, str | None]]) -> pa.Table:
        # ParquetFile, not read_table: no dataset discovery per file (many caches: many tiny files).
        pf = pq.ParquetFile(file_source(item[0]))
        have = set(pf.schema_arrow.names)
        table = pf.read(columns=[c for c in data_columns if c in have])
        for name in data_columns:
            if name not in have:  # a column the table got later (source_generation): null in older files
                table = table.append_column(
                    data_schema.field(name), pa.nulls(table.num_rows, data_schema.field(name).type)
                )
        table = table.select(data_columns)
        return table if table.schema.equals(data_schema) else table.cast(data_schema)

    if not files:
        return schema.empty_table()
    with ThreadPoolExecutor(max_workers=4) as pool:
        tables = list(pool.map(read, files))
    data = pa.concat_tables(tables)
    # Partition values are in the log, not the files: one column for all files at once.
    of_row = pa.array(np.repeat(np.arange(len(files)), [t.num_rows for t in tables]))
    for name in PARTITION_BY:
        values = pa.array([partitions.get(name) for _, partitions in files], pa.string())
        data = data.append_column(name, values.take(of_row))
    return data.select(list(_FEED_READ)).cast(schema)


def _feed_files(changes: LakeDir, start: int, end: int) -> list[tuple[LakeDir, dict[str, str | None]]]:
    """The files holding exactly the rows versions ``start..end`` added, with their partition values.

    Where a rearranging commit in the range (``dataChange = false``: the writer's small-file rewrites, an
    OPTIMIZE) replaced only files the range added, its new files are read instead: the same rows of the same
    partition in fewer, larger files (a minute of realtime commits is thousands of tiny files, their rewrites a
    few dozen), and opening a file costs more than its rows. A rewrite that also took a file from before
    ``start`` leaves its inputs to be read as they are (they stay on disk: ``lake vacuum`` keeps every file
    of changes not yet compacted, ``ops.check_vacuum``)."""
    pending: dict[str, tuple[LakeDir, dict[str, str | None]]] = {}
    for version in range(start, end + 1):
        try:
            actions = read_commit(changes, version)
        except FileNotFoundError as exc:
            raise DeltaLogError(
                f"{changes}: commit {version} is no longer in the log (older than delta.logRetentionDuration): "
                "its changes cannot be compacted incrementally"
            ) from exc
        moved: dict[str, tuple[list[str], list[tuple[LakeDir, dict[str, str | None]]]]] = {}
        blocked: set[str] = set()
        for action in actions:
            for kind in ("remove", "cdc"):
                if kind in action and action[kind].get("dataChange", True):
                    raise DeltaLogError(f"{changes} version {version}: a {kind} action in an append-only table")
            add = action.get("add")
            if add is not None:
                item = (_data_file(changes, add["path"]), add.get("partitionValues") or {})
                if add.get("dataChange", True):
                    pending[str(item[0])] = item
                elif add.get("deletionVector") is None:
                    moved.setdefault(_partition_key(item[1]), ([], []))[1].append(item)
            remove = action.get("remove")
            if remove is not None:
                name = str(_data_file(changes, remove["path"]))
                held = pending.get(name)
                if held is None:  # a file from before the range: its partition's new files are not ours alone
                    values = remove.get("partitionValues")
                    blocked.add(_partition_key(values) if values is not None else "*")
                    continue
                moved.setdefault(_partition_key(held[1]), ([], []))[0].append(name)
        for key, (removed, added) in moved.items():
            # Per partition: a rearranging commit keeps each partition's rows (a row's partition is its value).
            if removed and added and key not in blocked and "*" not in blocked:
                for name in removed:
                    del pending[name]
                pending.update((str(item[0]), item) for item in added)
    return list(pending.values())


def _partition_key(values: dict[str, str | None]) -> str:
    return repr(sorted(values.items()))


def _data_file(table: LakeDir, path: str) -> LakeDir:
    """An add action's file: a path relative to the table, or an absolute URI (both percent-encoded)."""
    from urllib.parse import urlparse

    if isinstance(table, ObjectPath) and "://" in path:
        raise DeltaLogError(f"{table}: add action with an absolute path {path!r} (not written by cdcd)")
    if "://" in path or path.startswith("file:"):
        return Path(unquote(urlparse(path).path))
    return table / unquote(path)


def require_live_files(changes: LakeDir, table: Any) -> None:
    """At the lake sink's start: every data file the changes table's current version names (its last
    checkpoint's and the commits' since, as delta-rs read them when it opened ``table``) exists with the
    size the log records. Otherwise ``DamagedLake``: one line naming the first such file, how many more,
    exit 8, as ``lake compact``/``verify``/``check`` stop. One stat per file (one listing on an object
    store), no file read."""
    from cdcd.lake.reading.check import DamagedLake

    adds = pa.table(table.get_add_actions(flatten=True))
    if not adds.num_rows:
        return
    files = [
        (_data_file(changes, path), int(size))
        for path, size in zip(adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist(), strict=True)
    ]
    found = _sizes(changes, [f for f, _ in files])
    bad: list[tuple[str, str]] = []
    for file, size in sorted(files, key=lambda f: str(f[0])):
        have = found.get(str(file))
        if have is None:
            bad.append((str(file), "named by the log but missing"))
        elif have != size:
            bad.append((str(file), f"{have:,} bytes where the log records {size:,}"))
    if bad:
        more = f" ({len(bad) - 1} more: `cdcd lake check`)" if len(bad) > 1 else ""
        path, what = bad[0]
        raise DamagedLake(
            path,
            what,
            f"restore it from a backup; else drop it from the log (delta-rs: DeltaTable('{changes}').repair()) "
            f"and land its rows again (`cdcd resend`){more}",
        )


def _sizes(changes: LakeDir, files: list[LakeDir]) -> dict[str, int]:
    """str(file) -> size, of each of ``files`` that exists."""
    import os

    out: dict[str, int] = {}
    if isinstance(changes, ObjectPath):
        from pyarrow import fs as pafs

        infos = changes.fs.get_file_info(pafs.FileSelector(changes.fs_path, recursive=True, allow_not_found=True))
        by_fs_path = {info.path: int(info.size) for info in infos if info.type == pafs.FileType.File}
        for file in files:
            size = by_fs_path.get(file.fs_path) if isinstance(file, ObjectPath) else None
            if size is not None:
                out[str(file)] = size
        return out
    for file in files:
        try:
            out[str(file)] = os.stat(str(file)).st_size
        except FileNotFoundError:
            continue
    return out
