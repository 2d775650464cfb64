"""MessagePack keys and values as JSON text: the definition the lake's C module follows.

``cdcd/lake/_rows.c`` writes the JSON text of keys and values while it reads records into columns,
and calls ``to_json_bytes`` for every value it does not write itself (extension types, map keys
that are not strings or that repeat, invalid UTF-8, deep nesting), so what lands is always what
this function writes; tests compare the two on generated values.
"""

from __future__ import annotations

import msgspec

from cdcd.wal.dump import jsonable

_msgpack = msgspec.msgpack.Decoder()
_json = msgspec.json.Encoder()

Buffer = bytes | memoryview | msgspec.Raw


def to_json_bytes(raw: Buffer) -> bytes:
    """One MessagePack key or value as UTF-8 JSON. Map keys JSON cannot hold as they are (tuples,
    bools, ...) become their JSON text; msgspec already writes int, float and bytes keys the way
    that fallback does, so both paths agree wherever both work."""
    value = _msgpack.decode(raw)
    try:
        return _json.encode(value)
    except TypeError:
        return _json.encode(jsonable(value))
