"""Change-log rows as Arrow columns, built straight from decoded WAL entries."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.lake.jsontext import joined, json_texts, to_json_bytes
from cdcd.lake.table import CHANGE_SCHEMA, DAY_FIELD
from cdcd.wal.records import DataEntry, Op

SCHEMA = CHANGE_SCHEMA
"""The changes table's columns (cdcd/lake/table.py); ``cache`` (and ``day`` when enabled) are Delta
partition columns."""

_OPS = pa.array([OP_NAMES[op] for op in sorted(Op)], pa.string())
"""Indexed by the Op value."""

_DAY_NS = 86_400 * 10**9
_op = attrgetter("op")
_key = attrgetter("key")
_value = attrgetter("value")
_partition = attrgetter("partition")
_primary = attrgetter("primary")
_version = attrgetter("version")
_order = attrgetter("order")
_cluster = attrgetter("cluster_id")
_node_order = attrgetter("node_order")
_topology = attrgetter("topology_version")
_cache_id = attrgetter("cache_id")
_expire = attrgetter("expire_time_ms")


def to_json(raw: bytes | msgspec.Raw) -> str:
    """MessagePack key or value as JSON text (maps with non-string keys get string keys)."""
    return to_json_bytes(raw).decode()


def split_slices(slices: list[RecordSlice], parts: int, min_rows: int) -> list[list[RecordSlice]]:
    """``slices`` cut at record boundaries into at most ``parts`` runs of about equal rows, none
    (but a lone one) under ``min_rows``."""
    total = sum(s.end - s.start for s in slices)
    parts = max(1, min(parts, total // max(1, min_rows)))
    if parts == 1:
        return [slices]
    out: list[list[RecordSlice]] = [[]]
    target = total / parts
    rows = 0
    for s in slices:
        if rows >= target * len(out) and len(out) < parts:
            out.append([])
        out[-1].append(s)
        rows += s.end - s.start
    return out


def _key_value_columns(
    offsets: np.ndarray[Any, Any], data: bytes, n: int, deletes: np.ndarray[Any, Any]
) -> tuple[pa.Array, pa.Array]:
    """Keys and values (null on delete) as two zero-copy slices of one Arrow string buffer holding
    the JSON texts of ``n`` keys followed by ``n`` values (``pa.array`` over a million Python bytes
    objects would cost as much again as producing them)."""
    if len(data) >= 2**31:
        raise ValueError(f"{len(data)} bytes of JSON in one batch: over Arrow's 2 GiB limit, lower batch_max_bytes")
    offsets_buf = pa.py_buffer(offsets.astype(np.int32))
    data_buf = pa.py_buffer(data)
    keys = pa.StringArray.from_buffers(n, offsets_buf, data_buf, None, 0, 0)
    null_count = int(deletes.sum())
    if not null_count:
        return keys, pa.StringArray.from_buffers(n, offsets_buf, data_buf, None, 0, n)
    valid = np.concatenate([np.ones(n, np.bool_), ~deletes])
    validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return keys, pa.StringArray.from_buffers(n, offsets_buf, data_buf, validity, null_count, n)


def _ints(values: Iterator[Any], dtype: type, n: int) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = np.fromiter(values, dtype, n)
    return out


def build_table(
    slices: list[RecordSlice],
    names: EventBatch,
    source_node: str,
    partition_by_day: bool,
    generation: int = 0,
) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """The rows of ``slices`` as one Arrow table, plus (rows, max commit ts ns) per cache.

    Column by column over the flat entry list (C-level ``map``/``np.fromiter``), per-record
    fields repeated with numpy: no per-row Python tuples, dicts or appends."""
    entries: list[DataEntry] = []
    counts, segments, offsets, commit_ns = [], [], [], []
    index: list[int] = []
    for s in slices:
        rec_entries = s.record.entries
        n = len(rec_entries) if s.stop is None else s.stop
        entries.extend(rec_entries[s.start : s.stop] if s.start or s.stop is not None else rec_entries)
        index.extend(range(s.start, n))
        counts.append(n - s.start)
        segments.append(s.pointer.segment)
        offsets.append(s.pointer.offset)
        commit_ns.append(s.record.commit_ts_ns)
    n = len(entries)
    reps = np.array(counts, np.int64)
    ts_ns = np.repeat(np.array(commit_ns, np.int64), reps)
    ops = _ints(map(_op, entries), np.int8, n)
    versions = list(map(_version, entries))
    cache_ids = _ints(map(_cache_id, entries), np.int64, n)
    ids, which = np.unique(cache_ids, return_inverse=True)
    cache_names = [names.cache_name(int(i)) for i in ids]
    commit_ts = pa.array(ts_ns // 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    partitions = pa.array(_ints(map(_partition, entries), np.int32, n))
    primaries = pa.array(_ints(map(_primary, entries), np.bool_, n))
    orders = pa.array(_ints(map(_order, versions), np.int64, n))
    clusters = pa.array(_ints(map(_cluster, versions), np.int32, n))
    offsets_, data = joined(json_texts(list(map(_key, entries)) + list(map(_value, entries))))
    keys, values = _key_value_columns(offsets_, data, n, ops == Op.DELETE)
    columns = [
        _OPS.take(pa.array(ops)),
        keys,
        values,
        partitions,
        primaries,
        orders,
        clusters,
        pa.array(_ints(map(_node_order, versions), np.int32, n)),
        pa.array(_ints(map(_topology, versions), np.int64, n)),
        commit_ts,
        pa.array([source_node], pa.string()).take(pa.array(np.zeros(n, np.int32))),
        pa.array(np.repeat(np.array(segments, np.int64), reps)),
        pa.array(np.repeat(np.array(offsets, np.int64), reps)),
        pa.array(np.array(index, np.int32)),
        pa.array(_ints(map(_expire, entries), np.int64, n)),
        pa.array(cache_names, pa.string()).take(pa.array(which)),
        pa.array(np.full(n, generation, np.int32)),
    ]
    rows = np.bincount(which, minlength=len(ids))
    max_ts = np.zeros(len(ids), np.int64)
    np.maximum.at(max_ts, which, ts_ns)
    stats = {name: (int(rows[i]), int(max_ts[i])) for i, name in enumerate(cache_names)}
    schema = SCHEMA
    if partition_by_day:
        day_numbers, day_of_row = np.unique(ts_ns // _DAY_NS, return_inverse=True)
        days = [datetime.fromtimestamp(int(d) * 86400, UTC).strftime("%Y-%m-%d") for d in day_numbers]
        columns.append(pa.array(days, pa.string()).take(pa.array(day_of_row)))
        schema = schema.append(DAY_FIELD)
    return pa.Table.from_arrays(columns, schema=schema), stats
