"""The lake's change rows as column buffers, in Python: what the C module (cdcd/lake/landing/_rows.c) does,
for a machine where it was not built.

Same input (``cdcd.lake.landing.arrow.pack``: MessagePack ``[segment, offset, start, stop | nil, record]``
per slice), same output: 13 fixed-width native-endian buffers and the int32 offsets plus UTF-8 text
of keys and values, in the order ``_rows.columns`` documents. msgspec reads the records; every value
goes through ``fallback`` (``jsontext.to_json_bytes``) and every key through ``key_fallback``
(``jsontext.key_json_bytes``), whose texts are the definitions the C code follows byte for byte, so
both paths land the same rows.

Fields past the ones read are skipped, as in C (the record schema only ever appends fields), and
entries outside a slice are read only as far as needed to skip them. Malformed input raises
ValueError naming the place (a msgspec path such as ``$[0][4]``, not a byte offset). One difference
is left on purpose: msgspec skips nested values recursively, so a value nested past the
interpreter's recursion limit in a part that is only skipped (an entry outside the slice, a field
a later schema added, a DELETE's value) raises RecursionError here where C skips it; such a value
fails both paths as soon as it is a key or value of a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import msgspec
import numpy as np

FIXED_DTYPES: tuple[type[np.generic], ...] = (
    *(np.int8, np.int32, np.bool_, np.int64, np.int32, np.int32, np.int64, np.int64),
    *(np.int64, np.int64, np.int64, np.int32, np.int64),
)
"""The dtypes of the 13 fixed-width buffers, in their order: op, partition, primary, order, node_order,
cluster_id, topology_version, expire_time_ms, cache_id, segment, offset, index, commit_ts_ns."""

_INT32_MAX = 2**31 - 1
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=_INT32_MAX)]
_DELETE = 2


class _Version(msgspec.Struct, array_like=True):
    order: I64
    node_order: I32
    cluster_id: I32
    topology_version: I64


class _Entry(msgspec.Struct, array_like=True):
    cache_id: I64
    op: Annotated[int, msgspec.Meta(ge=0, le=2)]
    key: msgspec.Raw
    value: msgspec.Raw
    partition: I32
    version: _Version
    primary: bool
    expire_time_ms: I64


class _Record(msgspec.Struct, array_like=True):
    tag: I64
    entries: list[msgspec.Raw]
    """Raw: entries outside the slice are only skipped, as in C."""
    commit_ts_ns: I64


class _Slice(msgspec.Struct, array_like=True):
    segment: I64
    offset: I64
    start: I64
    stop: I64 | None
    record: _Record


_slices = msgspec.msgpack.Decoder(list[_Slice])
_entry = msgspec.msgpack.Decoder(_Entry)


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"packed lake rows at {where}: {what}")


def _text(pieces: list[bytes]) -> tuple[bytes, bytes]:
    """Arrow's string layout: int32 offsets (one more than pieces) and the joined text."""
    data = b"".join(pieces)
    if len(data) > _INT32_MAX:
        raise ValueError(f"{len(data)} bytes of JSON in one batch: over Arrow's 2 GiB limit, lower batch_max_bytes")
    offsets = np.zeros(len(pieces) + 1, np.int32)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    return offsets.tobytes(), data


def columns(
    packed: bytes, fallback: Callable[[bytes], bytes], key_fallback: Callable[[bytes], bytes], /
) -> tuple[int, tuple[bytes, ...]]:
    """The rows of packed record slices as ``_rows.columns`` returns them: (rows, 17 buffers)."""
    try:
        slices = _slices.decode(packed)
    except msgspec.DecodeError as exc:
        raise _bad("$", str(exc)) from None
    fixed: tuple[list[int], ...] = tuple([] for _ in range(13))
    ops, partitions, primaries, orders, node_orders, clusters, topologies, expires = fixed[:8]
    caches, segments, offsets, indexes, commit_ns = fixed[8:]
    keys: list[bytes] = []
    values: list[bytes] = []
    for i, s in enumerate(slices):
        record = s.record
        if record.tag != 1:
            raise _bad(f"$[{i}][4]", "record is not a DataRecord (tag 1)")
        count = len(record.entries)
        stop = count if s.stop is None else s.stop
        if s.start < 0 or s.start > stop or stop > count:
            raise _bad(f"$[{i}]", "slice start/stop outside the record")
        for j in range(s.start, stop):
            try:
                e = _entry.decode(record.entries[j])
            except msgspec.DecodeError as exc:
                raise _bad(f"$[{i}][4][1][{j}]", str(exc)) from None
            keys.append(key_fallback(bytes(e.key)))
            values.append(b"" if e.op == _DELETE else fallback(bytes(e.value)))
            v = e.version
            ops.append(e.op)
            partitions.append(e.partition)
            primaries.append(e.primary)
            orders.append(v.order)
            node_orders.append(v.node_order)
            clusters.append(v.cluster_id)
            topologies.append(v.topology_version)
            expires.append(e.expire_time_ms)
            caches.append(e.cache_id)
            segments.append(s.segment)
            offsets.append(s.offset)
            indexes.append(j)
            commit_ns.append(record.commit_ts_ns)
    out = [np.array(column, dtype).tobytes() for column, dtype in zip(fixed, FIXED_DTYPES, strict=True)]
    return len(ops), (*out, *_text(keys), *_text(values))
