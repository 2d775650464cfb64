"""Records as plain JSON-able dicts, for ``cdcd wal dump`` and debugging."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from cdcd.wal.pointer import WalPointer
from cdcd.wal.reader import SegmentReader, WalReader, check_record_start
from cdcd.wal.records import CacheOp, DataEntry, DataRecord, Op, Record
from cdcd.wal.segment import list_segments

_decoder = msgspec.msgpack.Decoder()
_OPS = {Op.CREATE: "create", Op.UPDATE: "update", Op.DELETE: "delete"}


def json_key(key: Any) -> str:
    """A map key as a JSON object key: numbers and bytes exactly as msgspec writes them as keys
    (the lake's JSON text must not depend on which path made it), anything else as its JSON text."""
    if isinstance(key, str):
        return key
    if isinstance(key, int | float | bytes) and not isinstance(key, bool):
        return msgspec.json.encode({key: None})[2:-7].decode()  # '{"<key>":null}'
    return msgspec.json.encode(jsonable(key)).decode()


def jsonable(obj: Any) -> Any:
    """Map keys that JSON cannot hold (ints, tuples, ...) become strings; bytes stay (base64 in JSON)."""
    if isinstance(obj, dict):
        return {json_key(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    return obj


def entry_to_dict(e: DataEntry) -> dict[str, Any]:
    return {
        "cache_id": e.cache_id,
        "op": _OPS[e.op],
        "key": jsonable(_decoder.decode(e.key)),
        "value": jsonable(_decoder.decode(e.value)),
        "partition": e.partition,
        "version": _struct_dict(e.version),
        "primary": e.primary,
        "expire_time_ms": e.expire_time_ms,
    }


def record_to_dict(ptr: WalPointer, record: Record) -> dict[str, Any]:
    out: dict[str, Any] = {"pos": str(ptr), "segment": ptr.segment, "offset": ptr.offset, "type": type(record).__name__}
    if isinstance(record, DataRecord):
        out["commit_ts_ns"] = record.commit_ts_ns
        out["entries"] = [entry_to_dict(e) for e in record.entries]
        if record.resend:
            out["resend"] = True
    else:
        fields = {f: getattr(record, f) for f in record.__struct_fields__}
        for name, value in fields.items():
            if isinstance(value, CacheOp):
                fields[name] = value.name.lower()
            elif isinstance(value, msgspec.Struct):
                fields[name] = _struct_dict(value)
        out.update(fields)
    return out


def _struct_dict(s: msgspec.Struct) -> dict[str, Any]:
    """Field names even for array-like Structs (which msgspec encodes as arrays)."""
    out: dict[str, Any] = {}
    for name in s.__struct_fields__:
        value = getattr(s, name)
        out[name] = _struct_dict(value) if isinstance(value, msgspec.Struct) else value
    return out


def open_records(path: Path, start: WalPointer | None, *, active: bool = False) -> Iterable[tuple[WalPointer, Record]]:
    """What ``cdcd wal dump PATH`` reads: a segment file, or a directory of segments; a node's work
    dir (one holding ``archive/``) with its archive, from its newest segment on as active (a running
    node may roll and archive meanwhile: the reader follows). A ``start`` offset must be a record start."""
    if not path.is_dir():
        offset = start.offset if start else 0
        if offset:
            check_record_start(path, offset)
        return SegmentReader(path, start_offset=offset, archived=not active)
    dirs = [path]
    active_segment = None
    if (path / "archive").is_dir():
        dirs = [path / "archive", path]
        work, _ = list_segments(path)
        archived, _ = list_segments(path / "archive")
        # An empty work dir (between a roll and the next segment): every listed segment is complete.
        active_segment = max(work) if work else max(archived, default=-1) + 1
    reader = WalReader(dirs, start, active_segment=active_segment, follow=active_segment is not None)
    if start is not None and start.offset:
        first = reader.segments().get(start.segment)
        if first is not None:
            check_record_start(first, start.offset)
    return reader
