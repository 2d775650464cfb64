"""Change-log rows as Arrow columns, built straight from decoded WAL entries."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.wal.dump import jsonable
from cdcd.wal.pointer import WalPosition

SCHEMA = pa.schema(
    [
        ("op", pa.string()),
        ("key", pa.string()),
        ("value", pa.string()),
        ("partition", pa.int32()),
        ("primary", pa.bool_()),
        ("version_order", pa.int64()),
        ("version_cluster_id", pa.int32()),
        ("commit_ts", pa.timestamp("us", tz="UTC")),
        ("source_node", pa.string()),
        ("wal_segment", pa.int64()),
        ("wal_offset", pa.int64()),
        ("wal_index", pa.int32()),
        ("cache", pa.string()),
    ]
)
"""``cache`` (and ``day`` when enabled) become directory partitions: changes/cache=<name>/day=.../"""

_msgpack = msgspec.msgpack.Decoder()
_json = msgspec.json.Encoder()


def to_json(raw: bytes | msgspec.Raw) -> str:
    """MessagePack key or value as JSON text (maps with non-string keys get string keys)."""
    value = _msgpack.decode(raw)
    if isinstance(value, dict | list):
        value = jsonable(value)
    return _json.encode(value).decode()


def after(position: WalPosition, high_water: WalPosition | None) -> bool:
    return high_water is None or position > high_water


def filter_slices(batch: EventBatch, high_water: WalPosition | None) -> list[RecordSlice]:
    """Drop every entry at or below ``high_water`` (a replay); a partly new batch keeps its new part."""
    if high_water is None:
        return list(batch.slices)
    out = []
    for s in batch.slices:
        ptr = s.pointer
        n = len(s.record.entries)
        if WalPosition(ptr.segment, ptr.offset, n - 1) <= high_water:
            continue
        start = s.start
        if (ptr.segment, ptr.offset) == (high_water.segment, high_water.offset):
            start = max(start, high_water.entry_index + 1)
        out.append(RecordSlice(ptr, s.record, start) if start != s.start else s)
    return out


def build_table(
    slices: list[RecordSlice], names: EventBatch, source_node: str, partition_by_day: bool
) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """The rows of ``slices`` as one Arrow table, plus (rows, max commit ts ns) per cache."""
    op, key, value, part, primary, order, cluster = [], [], [], [], [], [], []
    ts, seg, off, idx, cache = [], [], [], [], []
    stats: dict[str, tuple[int, int]] = {}
    for s in slices:
        ptr = s.pointer
        rec = s.record
        commit_us = rec.commit_ts_ns // 1000
        entries = rec.entries
        for i in range(s.start, len(entries)):
            e = entries[i]
            name = names.cache_name(e.cache_id)
            op.append(OP_NAMES[e.op])
            key.append(to_json(e.key))
            value.append(to_json(e.value) if e.op != 2 else None)
            part.append(e.partition)
            primary.append(e.primary)
            order.append(e.version.order)
            cluster.append(e.version.cluster_id)
            ts.append(commit_us)
            seg.append(ptr.segment)
            off.append(ptr.offset)
            idx.append(i)
            cache.append(name)
            rows, max_ts = stats.get(name, (0, 0))
            stats[name] = (rows + 1, max(max_ts, rec.commit_ts_ns))
    n = len(op)
    commit_ts = pa.array(ts, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    columns = [
        pa.array(op, pa.string()),
        pa.array(key, pa.string()),
        pa.array(value, pa.string()),
        pa.array(part, pa.int32()),
        pa.array(primary, pa.bool_()),
        pa.array(order, pa.int64()),
        pa.array(cluster, pa.int32()),
        commit_ts,
        pa.array([source_node] * n, pa.string()),
        pa.array(seg, pa.int64()),
        pa.array(off, pa.int64()),
        pa.array(idx, pa.int32()),
        pa.array(cache, pa.string()),
    ]
    schema = SCHEMA
    if partition_by_day:
        columns.append(pc.strftime(commit_ts, format="%Y-%m-%d"))
        schema = schema.append(pa.field("day", pa.string()))
    return pa.Table.from_arrays(columns, schema=schema), stats
