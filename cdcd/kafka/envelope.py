"""Debezium's change-event envelope, so Kafka Connect sinks (Debezium's JDBC sink among them), Flink,
ksqlDB and Spark read cdcd's topics with what they already have for Debezium.

A cache key becomes the row's key columns: a map with string keys is the columns as they are (a
composite key), any other key is wrapped as ``{"key": K}``. A value becomes the row's other
columns the same way: a map with string keys as is, anything else (a number, a string, a list, a
map with other keys, binary) wrapped as ``{"value": V}``. The row (``after``) is the key columns
followed by the value's (a value column named like a key column gives way to the key's). Inside a
row, map keys that JSON cannot hold become strings and binary becomes base64, as ``cdcd wal dump``
prints them.

Message value::

    {"before": KEY-COLUMNS (deletes) | null, "after": ROW | null,
     "source": {"version", "connector": "cdcd", "name", "db", "table", "node", "generation", "cache", "partition",
                "segment", "offset", "entry_index", "ts_ms", "ts_us", "ts_ns", "snapshot", "primary",
                "cache_version": {"order", "node_order", "cluster_id", "topology_version"}},
     "op": "c"|"u"|"d"|"r"|"t", "ts_ms", "ts_us", "ts_ns",
     "transaction": {"id", "total_order", "data_collection_order"}}

``before`` of a delete holds the key columns, the rest absent: a WAL entry holds the new value
only, which is what Debezium's PostgreSQL connector sends with ``REPLICA IDENTITY DEFAULT``
(updates: null). A dropped cache is Debezium's truncate event (``op = "t"``, ``before`` and ``after``
null, message key null), sent to every partition of the cache's topic. Message key: the key
columns with one topic per cache; ``{"cache", "key"}`` in the single-topic mode, where keys of
different caches share a topic.

With ``schemas = true`` key and value are Kafka Connect JSON (``{"schema", "payload"}``), the
schema inferred from each message (what ``JsonConverter`` with ``schemas.enable`` expects, and
what Debezium's JDBC sink needs).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import msgspec

from cdcd.wal.dump import jsonable
from cdcd.wal.pointer import EventAddress
from cdcd.wal.records import CacheVersion, DataEntry, Op

try:  # not ``cdcd.__version__``: the package root is the composition root, above every layer
    __version__ = metadata.version("cdcd")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "unknown"

OPS = {Op.CREATE: "c", Op.UPDATE: "u", Op.DELETE: "d"}
SNAPSHOT_OP = "r"
TRUNCATE_OP = "t"
KEY_COLUMN = "key"
VALUE_COLUMN = "value"

_decode = msgspec.msgpack.Decoder().decode
_encode = msgspec.json.Encoder().encode


def columns(raw: bytes | msgspec.Raw, wrap_as: str) -> dict[str, Any]:
    """A MessagePack key or value as row columns (a string-keyed map as is, anything else wrapped
    as ``{wrap_as: V}``; an empty map too when it is a key, which needs a column)."""
    value = _decode(raw)
    if isinstance(value, dict) and (value or wrap_as != KEY_COLUMN) and all(isinstance(k, str) for k in value):
        out: dict[str, Any] = jsonable(value)
        return out
    return {wrap_as: jsonable(value)}


def row(key_columns: dict[str, Any], raw_value: bytes | msgspec.Raw) -> dict[str, Any]:
    """The key columns, then the value's (a value column of a key column's name gives way)."""
    out = dict(key_columns)
    for name, v in columns(raw_value, VALUE_COLUMN).items():
        if name not in out:
            out[name] = v
    return out


class _Key(msgspec.Struct):
    cache: str
    key: Any


class _CacheVersion(msgspec.Struct):
    order: int
    node_order: int
    cluster_id: int
    topology_version: int


class _Source(msgspec.Struct):
    version: str
    connector: str
    name: str
    db: str
    table: str
    node: str
    generation: int
    cache: str
    partition: int
    segment: int
    offset: int
    entry_index: int
    ts_ms: int
    ts_us: int
    ts_ns: int
    snapshot: str
    primary: bool
    cache_version: _CacheVersion


class _Transaction(msgspec.Struct):
    id: str
    total_order: int
    data_collection_order: int


class _Envelope(msgspec.Struct):
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    source: _Source
    op: str
    ts_ms: int
    ts_us: int
    ts_ns: int
    transaction: _Transaction


class Source(msgspec.Struct, frozen=True):
    """Where a change comes from: what the sink knows of it besides the entry."""

    name: str
    """``source.name``: the logical server name (the topic prefix)."""
    db: str
    node: str
    generation: int
    cache: str
    position: EventAddress
    commit_ts_ns: int
    resend: bool


def change(
    e: DataEntry, src: Source, now_ns: int, total_order: int, order: int, *, per_cache: bool, schemas: bool
) -> tuple[bytes, bytes]:
    """The message key and value of one change (``order``: its ``data_collection_order``)."""
    cache = src.cache
    schema_name = f"{src.name}.{cache}"
    key_columns = columns(e.key, KEY_COLUMN)
    key: Any
    if per_cache:
        key = key_columns
    elif schemas:
        key = {"cache": cache, "key": jsonable(_decode(e.key))}
    else:
        key = _Key(cache, jsonable(_decode(e.key)))
    if schemas:
        key = {"schema": _struct_schema(key, f"{schema_name}.Key", optional=False), "payload": key}
    deleted = e.op == Op.DELETE
    after = None if deleted else row(key_columns, e.value)
    before = key_columns if deleted else None
    pos = src.position
    op = SNAPSHOT_OP if src.resend else OPS[e.op]
    envelope = _Envelope(
        before,
        after,
        _source(src, e.partition, e.version, snapshot=op == SNAPSHOT_OP, primary=e.primary),
        op,
        now_ns // 1_000_000,
        now_ns // 1_000,
        now_ns,
        _Transaction(transaction_id(src.node, src.generation, pos.segment, pos.offset), total_order, order),
    )
    if not schemas:
        return _encode(key), _encode(envelope)
    schema = envelope_schema(schema_name, after if after is not None else before)
    return _encode(key), _encode({"schema": schema, "payload": envelope})


def truncate(src: Source, version: CacheVersion | None, partition: int, now_ns: int, *, schemas: bool) -> bytes:
    """The value of Debezium's truncate event for a dropped cache: ``before`` and ``after`` null, the
    source block at the DESTROY record (``cache_version``: the version the node's next write gets)."""
    pos = src.position
    envelope = _Envelope(
        None,
        None,
        _source(src, partition, version or CacheVersion(0, 0, 0, 0), snapshot=False, primary=True),
        TRUNCATE_OP,
        now_ns // 1_000_000,
        now_ns // 1_000,
        now_ns,
        _Transaction(transaction_id(src.node, src.generation, pos.segment, pos.offset), 1, 1),
    )
    if not schemas:
        return _encode(envelope)
    return _encode({"schema": envelope_schema(f"{src.name}.{src.cache}", None), "payload": envelope})


def _source(src: Source, partition: int, v: CacheVersion, *, snapshot: bool, primary: bool) -> _Source:
    """The envelope's ``source`` block of an event at ``src.position`` (a change or a truncate)."""
    pos = src.position
    ts_ns = src.commit_ts_ns
    return _Source(
        __version__,
        "cdcd",
        src.name,
        src.db,
        src.cache,
        src.node,
        src.generation,
        src.cache,
        partition,
        pos.segment,
        pos.offset,
        pos.entry_index,
        ts_ns // 1_000_000,
        ts_ns // 1_000,
        ts_ns,
        "true" if snapshot else "false",
        primary,
        _CacheVersion(v.order, v.node_order, v.cluster_id, v.topology_version),
    )


def transaction_id(node: str, generation: int, segment: int, offset: int) -> str:
    """A node transaction (one WAL record) by its source node, generation and WAL address."""
    return f"{node}:{segment}:{offset}" if not generation else f"{node}:g{generation}:{segment}:{offset}"


# --- Kafka Connect JSON schemas ----------------------------------------------------------------


def _schema(value: Any, field: str | None = None) -> dict[str, Any]:
    if isinstance(value, bool):
        out: dict[str, Any] = {"type": "boolean", "optional": True}
    elif isinstance(value, int):
        out = {"type": "int64", "optional": True}
    elif isinstance(value, float):
        out = {"type": "double", "optional": True}
    elif isinstance(value, bytes):
        out = {"type": "bytes", "optional": True}
    elif isinstance(value, list):
        items = _schema(value[0]) if value else {"type": "string", "optional": True}
        out = {"type": "array", "items": items, "optional": True}
    elif isinstance(value, dict):
        out = _struct_schema(value, None, optional=True)
    else:  # str, or None (no type to infer: a nullable string)
        out = {"type": "string", "optional": True}
    if field is not None:
        out["field"] = field
    return out


def _struct_schema(value: dict[str, Any], name: str | None, *, optional: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "struct",
        "fields": [_schema(v, k) for k, v in value.items()],
        "optional": optional,
    }
    if name:
        out["name"] = name
    return out


def _fixed(field: str, type_: str, *, optional: bool = False) -> dict[str, Any]:
    return {"type": type_, "optional": optional, "field": field}


_SOURCE_SCHEMA = {
    "type": "struct",
    "name": "io.cdcd.connector.Source",
    "optional": False,
    "field": "source",
    "fields": [
        _fixed("version", "string"),
        _fixed("connector", "string"),
        _fixed("name", "string"),
        _fixed("db", "string"),
        _fixed("table", "string"),
        _fixed("node", "string"),
        _fixed("generation", "int32"),
        _fixed("cache", "string"),
        _fixed("partition", "int32"),
        _fixed("segment", "int64"),
        _fixed("offset", "int64"),
        _fixed("entry_index", "int32"),
        _fixed("ts_ms", "int64"),
        _fixed("ts_us", "int64"),
        _fixed("ts_ns", "int64"),
        _fixed("snapshot", "string", optional=True),
        _fixed("primary", "boolean"),
        {
            "type": "struct",
            "optional": False,
            "field": "cache_version",
            "fields": [
                _fixed("order", "int64"),
                _fixed("node_order", "int64"),
                _fixed("cluster_id", "int32"),
                _fixed("topology_version", "int64"),
            ],
        },
    ],
}

_TRANSACTION_SCHEMA = {
    "type": "struct",
    "name": "event.block",
    "version": 1,
    "optional": True,
    "field": "transaction",
    "fields": [_fixed("id", "string"), _fixed("total_order", "int64"), _fixed("data_collection_order", "int64")],
}


def envelope_schema(schema_name: str, row_: dict[str, Any] | None) -> dict[str, Any]:
    """``schema_name``: ``<source.name>.<cache>``, Debezium's ``<prefix>.<schema>.<table>``."""
    row_schema = _struct_schema(row_ or {}, f"{schema_name}.Value", optional=True)
    return {
        "type": "struct",
        "name": f"{schema_name}.Envelope",
        "optional": False,
        "fields": [
            {**row_schema, "field": "before"},
            {**row_schema, "field": "after"},
            _SOURCE_SCHEMA,
            _fixed("op", "string"),
            _fixed("ts_ms", "int64", optional=True),
            _fixed("ts_us", "int64", optional=True),
            _fixed("ts_ns", "int64", optional=True),
            _TRANSACTION_SCHEMA,
        ],
    }
