"""Change-log rows as Arrow columns, built straight from decoded WAL entries."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import structlog

from cdcd.consumer import OP_NAMES, CacheDrop, EventBatch, RecordSlice
from cdcd.lake.landing import rows_py
from cdcd.lake.landing.jsontext import key_json_bytes, to_json_bytes
from cdcd.lake.table import CHANGE_SCHEMA, DAY_FIELD
from cdcd.wal.records import Op, encode_hook

log = structlog.get_logger("cdcd.lake")

SCHEMA = CHANGE_SCHEMA
"""The changes table's columns (cdcd/lake/table.py); ``cache`` (and ``day`` when enabled) are Delta
partition columns."""

_OPS = pa.array([OP_NAMES[op] for op in sorted(Op)], pa.string())
"""Indexed by the Op value."""

_DAY_NS = 86_400 * 10**9


def to_json(raw: bytes | msgspec.Raw) -> str:
    """MessagePack value as the lake's JSON text (maps with non-string keys get string keys)."""
    return to_json_bytes(raw).decode()


def key_to_json(raw: bytes | msgspec.Raw) -> str:
    """MessagePack key as the lake's key text: one text per key (cdcd/lake/landing/jsontext.py)."""
    return key_json_bytes(raw).decode()


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


_encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)

Fallback = Callable[[bytes], bytes]
RowBuilder = Callable[[bytes, Fallback, Fallback], tuple[int, tuple[bytes, ...]]]
"""``(packed, fallback, key_fallback) -> (rows, buffers)``: the C module (landing/_rows.c), or landing/rows_py.py."""

ROWS_ENV = "CDCD_LAKE_ROWS"
"""``python`` makes this process (and the Spark tasks it starts) build rows in Python even where the C
module is built: how the tests run the lake on both paths. Read once, at import."""

BUILD_HINT = "build it with `make install`, or `python setup.py build_ext --inplace` in the source tree"


def _python_rows(packed: bytes, fallback: Fallback, key_fallback: Fallback) -> tuple[int, tuple[bytes, ...]]:
    """The Python path for a process without the C module: says so once, at the first batch (when logging is
    set up, unlike at import), then builds the same columns, several times slower."""
    global build_columns
    log.warning("lake_rows_without_c_module", hint=f"cdcd.lake.landing._rows is not built: {BUILD_HINT}")
    build_columns = rows_py.columns
    return build_columns(packed, fallback, key_fallback)


def _row_builder(choice: str) -> RowBuilder:
    if choice == "python":
        return rows_py.columns
    if choice not in ("", "c"):
        raise ValueError(f"environment: {ROWS_ENV}={choice!r} is not 'c' or 'python'")
    try:
        from cdcd.lake.landing import _rows
    except ImportError:
        if choice == "c":
            raise ImportError(f"{ROWS_ENV}=c but cdcd.lake.landing._rows is not built: {BUILD_HINT}") from None
        return _python_rows
    return _rows.columns


build_columns: RowBuilder = _row_builder(os.environ.get(ROWS_ENV, ""))
"""The row builder this process uses: the C module, unless it is missing or ``$CDCD_LAKE_ROWS`` says
``python``."""


def pack(slices: Sequence[RecordSlice]) -> bytes:
    """``slices`` as ``build_columns`` reads them (landing/_rows.c, landing/rows_py.py): MessagePack of
    ``[segment, offset, start, stop, record]`` per slice, the record as the WAL holds it: its payload as
    read (``RecordSlice.payload``, copied as is: no encoding per entry) or, without one, ``record``
    encoded again: the same bytes for a record written with the current schema (one an older node wrote
    may lack fields appended since, which the row builders do not read)."""
    raw = msgspec.Raw
    return _encoder.encode(
        [
            (s.pointer.segment, s.pointer.offset, s.start, s.stop, s.record if s.payload is None else raw(s.payload))
            for s in slices
        ]
    )


def _text(n: int, offsets: bytes, data: bytes, validity: pa.Buffer | None = None, nulls: int = 0) -> pa.Array:
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data), validity, nulls)


def build_table(
    slices: Sequence[RecordSlice],
    names: EventBatch,
    source_node: str,
    partition_by_day: bool,
    generation: int = 0,
) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """The rows of ``slices`` as one Arrow table, plus (rows, max commit ts ns) per cache."""
    return table_from_packed(pack(slices), names.cache_names, source_node, partition_by_day, generation)


def table_from_packed(
    packed: bytes,
    cache_names: Mapping[int, str],
    source_node: str,
    partition_by_day: bool,
    generation: int = 0,
) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """The rows of packed slices (``pack``) as one Arrow table, plus (rows, max commit ts ns) per cache.

    The records are read, and keys and values written as JSON text, by ``build_columns`` (C code, without a
    Python object per row, unless it is not built) into column buffers that become Arrow arrays without
    a copy; per-cache and per-day columns are numpy over those buffers."""
    n, buffers = build_columns(packed, to_json_bytes, key_json_bytes)
    fixed: list[np.ndarray[Any, Any]] = [
        np.frombuffer(b, t) for b, t in zip(buffers, rows_py.FIXED_DTYPES, strict=False)
    ]
    ops, partitions, primaries, orders, node_orders, clusters, topologies, expires = fixed[:8]
    cache_ids, segments, offsets, index, ts_ns = fixed[8:]
    key_offsets, key_data, value_offsets, value_data = buffers[13:]
    deletes = ops == Op.DELETE
    nulls = int(deletes.sum())
    validity = pa.py_buffer(np.packbits(~deletes, bitorder="little")) if nulls else None
    ids, which = np.unique(cache_ids, return_inverse=True)
    cache_list = [cache_names.get(int(i)) or f"cache-{int(i)}" for i in ids]
    columns = [
        _OPS.take(pa.array(ops)),
        _text(n, key_offsets, key_data),
        _text(n, value_offsets, value_data, validity, nulls),
        pa.array(partitions),
        pa.array(primaries),
        pa.array(orders),
        pa.array(clusters),
        pa.array(node_orders),
        pa.array(topologies),
        pa.array(ts_ns // 1000, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        pa.array([source_node], pa.string()).take(pa.array(np.zeros(n, np.int32))),
        pa.array(segments),
        pa.array(offsets),
        pa.array(index),
        pa.array(expires),
        pa.array(cache_list, pa.string()).take(pa.array(which)),
        pa.array(np.full(n, generation, np.int32)),
    ]
    rows = np.bincount(which, minlength=len(ids))
    max_ts = np.zeros(len(ids), np.int64)
    np.maximum.at(max_ts, which, ts_ns)
    stats = {name: (int(rows[i]), int(max_ts[i])) for i, name in enumerate(cache_list)}
    schema = SCHEMA
    if partition_by_day:
        day_numbers, day_of_row = np.unique(ts_ns // _DAY_NS, return_inverse=True)
        days = [datetime.fromtimestamp(int(d) * 86400, UTC).strftime("%Y-%m-%d") for d in day_numbers]
        columns.append(pa.array(days, pa.string()).take(pa.array(day_of_row)))
        schema = schema.append(DAY_FIELD)
    return pa.Table.from_arrays(columns, schema=schema), stats


TRUNCATE = "truncate"
"""The ``op`` of a change row that empties a cache: its DESTROY (key and value null). Compaction
drops every row of the cache older than it from ``state`` and the cache's typed table."""


def truncate_table(drops: Sequence[CacheDrop], partition_by_day: bool, generation: int) -> pa.Table:
    """One ``truncate`` row per dropped cache, at its DESTROY record's place (entry index 0)."""
    versions = [d.version for d in drops]
    ts_ns = [d.ts_ns for d in drops]
    data: dict[str, pa.Array] = {
        "op": pa.array([TRUNCATE] * len(drops), pa.string()),
        "key": pa.nulls(len(drops), pa.string()),
        "value": pa.nulls(len(drops), pa.string()),
        "partition": pa.array([0] * len(drops), pa.int32()),
        "primary": pa.array([True] * len(drops)),
        "version_order": pa.array([v.order if v else 0 for v in versions], pa.int64()),
        "version_cluster_id": pa.array([v.cluster_id if v else 0 for v in versions], pa.int32()),
        "node_order": pa.array([v.node_order if v else 0 for v in versions], pa.int32()),
        "topology_version": pa.array([v.topology_version if v else 0 for v in versions], pa.int64()),
        "commit_ts": pa.array([t // 1000 for t in ts_ns], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "source_node": pa.array([d.source_node for d in drops], pa.string()),
        "wal_segment": pa.array([d.position.segment for d in drops], pa.int64()),
        "wal_offset": pa.array([d.position.offset for d in drops], pa.int64()),
        "wal_index": pa.array([0] * len(drops), pa.int32()),
        "expire_time_ms": pa.array([0] * len(drops), pa.int64()),
        "cache": pa.array([d.name for d in drops], pa.string()),
        "source_generation": pa.array([generation] * len(drops), pa.int32()),
    }
    schema = SCHEMA
    if partition_by_day:
        days = [datetime.fromtimestamp(t // 10**9, UTC).strftime("%Y-%m-%d") for t in ts_ns]
        data["day"] = pa.array(days, pa.string())
        schema = schema.append(DAY_FIELD)
    return pa.Table.from_pydict(data, schema=schema)
