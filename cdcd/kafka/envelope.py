"""Debezium's change-event envelope, so Kafka Connect sinks, Flink, ksqlDB and Spark read cdcd's
topic with what they already have for Debezium.

Message key: ``{"cache": NAME, "key": KEY}``. Message value::

    {"before": null, "after": ROW | null,
     "source": {"version", "connector": "cdcd", "name", "node", "cache", "partition",
                "segment", "offset", "entry_index", "ts_ms", "snapshot": "true"|"false",
                "primary", "cache_version": {"order", "node_order", "cluster_id", "topology_version"}},
     "op": "c"|"u"|"d"|"r", "ts_ms",
     "transaction": {"id", "total_order", "data_collection_order"}}

``before`` is always null: a cdcd WAL entry holds the new value only (Debezium's PostgreSQL
connector with ``REPLICA IDENTITY DEFAULT`` does the same for updates). A value that is a map with
string keys is the row as it is; any other value (a number, a string, a list, a map with other
keys, binary) is wrapped as ``{"value": V}``. Inside a row, map keys that JSON cannot hold become
strings and binary becomes base64, as ``cdcd wal dump`` prints them.

With ``schemas = true`` key and value are Kafka Connect JSON (``{"schema", "payload"}``), the
schema inferred from each message (what ``JsonConverter`` with ``schemas.enable`` expects).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import msgspec

from cdcd.wal.dump import jsonable
from cdcd.wal.records import CacheVersion, Op

try:  # not ``cdcd.__version__``: the package root is the composition root, above every layer
    __version__ = metadata.version("cdcd")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "unknown"

OPS = {Op.CREATE: "c", Op.UPDATE: "u", Op.DELETE: "d"}
SNAPSHOT_OP = "r"

_decode = msgspec.msgpack.Decoder().decode
_encode = msgspec.json.Encoder().encode


def row(raw: bytes | msgspec.Raw) -> dict[str, Any]:
    """A MessagePack value as an envelope row (a string-keyed map as is, anything else wrapped)."""
    value = _decode(raw)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out: dict[str, Any] = jsonable(value)
        return out
    return {"value": jsonable(value)}


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
    node: str
    cache: str
    partition: int
    segment: int
    offset: int
    entry_index: int
    ts_ms: int
    snapshot: str
    primary: bool
    cache_version: _CacheVersion


class _Transaction(msgspec.Struct):
    id: str
    total_order: int
    data_collection_order: int


class _Envelope(msgspec.Struct):
    before: None
    after: dict[str, Any] | None
    source: _Source
    op: str
    ts_ms: int
    transaction: _Transaction


def key_bytes(cache: str, raw_key: bytes | msgspec.Raw, schemas: bool) -> bytes:
    key = jsonable(_decode(raw_key))
    if schemas:
        payload = {"cache": cache, "key": key}
        return _encode({"schema": _struct_schema(payload, f"cdcd.{cache}.Key", optional=False), "payload": payload})
    return _encode(_Key(cache, key))


def value_bytes(
    *,
    name: str,
    node: str,
    cache: str,
    op: str,
    raw_value: bytes | msgspec.Raw | None,
    partition: int,
    segment: int,
    offset: int,
    entry_index: int,
    commit_ts_ns: int,
    primary: bool,
    version: CacheVersion,
    now_ms: int,
    data_collection_order: int,
    schemas: bool,
) -> bytes:
    after = None if raw_value is None else row(raw_value)
    envelope = _Envelope(
        None,
        after,
        _Source(
            __version__,
            "cdcd",
            name,
            node,
            cache,
            partition,
            segment,
            offset,
            entry_index,
            commit_ts_ns // 1_000_000,
            "true" if op == SNAPSHOT_OP else "false",
            primary,
            _CacheVersion(version.order, version.node_order, version.cluster_id, version.topology_version),
        ),
        op,
        now_ms,
        _Transaction(f"{node}:{segment}:{offset}", entry_index + 1, data_collection_order),
    )
    if not schemas:
        return _encode(envelope)
    return _encode({"schema": envelope_schema(cache, after), "payload": envelope})


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
        _fixed("node", "string"),
        _fixed("cache", "string"),
        _fixed("partition", "int32"),
        _fixed("segment", "int64"),
        _fixed("offset", "int64"),
        _fixed("entry_index", "int32"),
        _fixed("ts_ms", "int64"),
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


def envelope_schema(cache: str, after: dict[str, Any] | None) -> dict[str, Any]:
    row_schema = _struct_schema(after or {}, f"cdcd.{cache}.Value", optional=True)
    return {
        "type": "struct",
        "name": f"cdcd.{cache}.Envelope",
        "optional": False,
        "fields": [
            {**row_schema, "field": "before"},
            {**row_schema, "field": "after"},
            _SOURCE_SCHEMA,
            _fixed("op", "string"),
            _fixed("ts_ms", "int64", optional=True),
            _TRANSACTION_SCHEMA,
        ],
    }
