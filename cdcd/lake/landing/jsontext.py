"""MessagePack keys and values as JSON text: the definitions the lake's row builders follow.

Values: ``to_json_bytes``, what msgspec writes for the decoded value (NaN and the infinities as
``null``, bytes as base64 text: a value's text need not tell every value apart).

Keys: ``key_json_bytes``, one text per key, never one text for two keys (docs/lake.md, "Keys").
Ordinary keys — nil, bools, integers, finite floats, strings, arrays, maps whose keys are strings
not starting with ``$`` — are written exactly as values are; everything else becomes a one-member
object whose member name starts with ``$``, which an ordinary map never has:

- NaN and the infinities: ``{"$float":"NaN"}`` (any other NaN: ``"NaN:<16 hex digits of its bits>"``),
  ``{"$float":"Infinity"}``, ``{"$float":"-Infinity"}``;
- binary: ``{"$binary":"<base64>"}``;
- a map with a key that is not a string, starts with ``$`` or repeats: ``{"$map":[[k,v],...]}``,
  every pair in the key's own order, each ``k`` and ``v`` a key text itself;
- a timestamp (extension -1, a datetime on the node): ``{"$date":"2024-01-01T00:00:00.500000Z"}``
  (RFC 3339 UTC, 0, 6 or 9 fraction digits, as msgspec writes a datetime); any other extension
  value: ``{"$ext":[type,"<base64>"]}``.

``cdcd/lake/landing/_rows.c`` writes the JSON text of keys and values while it reads records into columns,
and calls these functions for every key or value it does not write itself (extension types, map keys
that are not plain strings, invalid UTF-8, deep nesting, a non-finite float32 key), so what lands is
always what they write; tests compare the two on generated values.
"""

from __future__ import annotations

import base64
import contextlib
import struct
from datetime import UTC, datetime, timedelta

import msgspec

from cdcd.wal.dump import jsonable

_msgpack = msgspec.msgpack.Decoder()
_json = msgspec.json.Encoder()

Buffer = bytes | memoryview | msgspec.Raw

KEY_MAX_NESTING = 256
"""Deepest key read (nested arrays and maps): the node's ``MAX_NESTING``, so no key the node accepts
is refused, and the limit is the same on every path (not the interpreter's stack)."""


class InvalidValue(ValueError):
    """A value that is not MessagePack the lake can write as JSON: malformed bytes, or a string that is not
    UTF-8 (its message then starts with "invalid UTF-8"). Both row builders raise it for such a value, whatever
    msgspec version decodes it (msgspec's own error for invalid UTF-8 changed type and words between releases)."""


def to_json_bytes(raw: Buffer) -> bytes:
    """One MessagePack value as UTF-8 JSON. Map keys JSON cannot hold as they are (tuples,
    bools, ...) become their JSON text; msgspec already writes int, float and bytes keys the way
    that fallback does, so both paths agree wherever both work. Raises ``InvalidValue`` for bytes that
    are not such a value."""
    try:
        value = _msgpack.decode(raw)
    except UnicodeDecodeError as exc:
        raise InvalidValue(f"invalid UTF-8 in a string value ({exc.reason})") from None
    except msgspec.DecodeError as exc:
        if "utf-8" in str(exc).lower():
            raise InvalidValue("invalid UTF-8 in a string value") from None
        raise InvalidValue(f"malformed MessagePack value ({exc})") from None
    try:
        return _json.encode(value)
    except TypeError:
        return _json.encode(jsonable(value))


# --- keys ------------------------------------------------------------------------------------------------
_NAN = 0x7FF8000000000000
"""The NaN Python's ``float("nan")`` and numpy write: plain ``"NaN"``; other NaNs carry their bits."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECONDS_MIN, _SECONDS_MAX = -62135596800, 253402300799
"""0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z: the timestamps a datetime holds."""


def key_json_bytes(raw: Buffer) -> bytes:
    """One MessagePack key as the lake's key text: distinct keys give distinct texts (module docstring).
    Malformed MessagePack raises ValueError naming the byte offset in the key (UnicodeDecodeError for
    a string that is not UTF-8)."""
    data = bytes(raw)
    if data and _PLAIN_SCALAR[data[0]]:
        # Strings and integers, most keys: their value text is their key text, and msgspec writes it faster.
        with contextlib.suppress(msgspec.DecodeError):  # malformed: the walk below names the byte
            return _json.encode(_msgpack.decode(data))
    out: list[bytes] = []
    end = _key(data, 0, out, 0)
    if end != len(data):
        raise ValueError(f"MessagePack key at byte {end}: trailing bytes after the key")
    return b"".join(out)


def _bad(at: int, what: str) -> ValueError:
    return ValueError(f"MessagePack key at byte {at}: {what}")


def _take(b: bytes, i: int, n: int) -> bytes:
    if len(b) - i < n:
        raise _bad(i, "truncated")
    return b[i : i + n]


def _uint(b: bytes, i: int, n: int) -> int:
    return int.from_bytes(_take(b, i, n), "big")


_CONSTANTS = {0xC0: b"null", 0xC2: b"false", 0xC3: b"true"}
_PLAIN_SCALAR = [
    b <= 0x7F or 0xA0 <= b <= 0xBF or b in _CONSTANTS or 0xCC <= b <= 0xD3 or 0xD9 <= b <= 0xDB or b >= 0xE0
    for b in range(256)
]
"""By type byte: nil, a bool, an integer or a string."""
_INT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_FIXEXT_SIZES = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
_LEN_SIZES = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_COUNT_SIZES = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}


def _key(b: bytes, i: int, out: list[bytes], depth: int) -> int:
    """The object at ``b[i]`` as key text appended to ``out``; where it ends. ``depth``: enclosing
    arrays and maps."""
    t = _uint(b, i, 1)
    if t <= 0x7F:
        out.append(str(t).encode())
        return i + 1
    if t >= 0xE0:
        out.append(str(t - 256).encode())
        return i + 1
    if t in _INT_SIZES:
        n = _INT_SIZES[t]
        out.append(str(int.from_bytes(_take(b, i + 1, n), "big", signed=t >= 0xD0)).encode())
        return i + 1 + n
    if t in _CONSTANTS:
        out.append(_CONSTANTS[t])
        return i + 1
    if 0xA0 <= t <= 0xBF or 0xD9 <= t <= 0xDB:
        n, start = (t & 0x1F, i + 1) if t <= 0xBF else (_uint(b, i + 1, _LEN_SIZES[t]), i + 1 + _LEN_SIZES[t])
        out.append(_json.encode(_take(b, start, n).decode("utf-8")))
        return start + n
    if t == 0xCB:
        out.append(_double(_uint(b, i + 1, 8)))
        return i + 9
    if t == 0xCA:
        out.append(_float32(_uint(b, i + 1, 4)))
        return i + 5
    if 0xC4 <= t <= 0xC6:
        start = i + 1 + _LEN_SIZES[t]
        data = _take(b, start, _uint(b, i + 1, _LEN_SIZES[t]))
        out += (b'{"$binary":"', base64.b64encode(data), b'"}')
        return start + len(data)
    if t in _FIXEXT_SIZES or 0xC7 <= t <= 0xC9:
        if t in _FIXEXT_SIZES:
            n, start = _FIXEXT_SIZES[t], i + 1
        else:
            n, start = _uint(b, i + 1, _LEN_SIZES[t]), i + 1 + _LEN_SIZES[t]
        code = int.from_bytes(_take(b, start, 1), "big", signed=True)
        data = _take(b, start + 1, n)
        out.append(_ext(code, data))
        return start + 1 + n
    if 0x90 <= t <= 0x9F or 0x80 <= t <= 0x8F or t in _COUNT_SIZES:
        if depth >= KEY_MAX_NESTING:
            raise _bad(i, f"key nested deeper than {KEY_MAX_NESTING} levels")
        if t <= 0x9F:
            n, start = t & 0x0F, i + 1
        else:
            n, start = _uint(b, i + 1, _COUNT_SIZES[t]), i + 1 + _COUNT_SIZES[t]
        if 0x90 <= t <= 0x9F or t in (0xDC, 0xDD):
            return _array(b, start, n, out, depth + 1)
        return _map(b, start, n, out, depth + 1)
    raise _bad(i, "invalid MessagePack type byte 0xc1")


def _array(b: bytes, i: int, n: int, out: list[bytes], depth: int) -> int:
    out.append(b"[")
    for k in range(n):
        if k:
            out.append(b",")
        i = _key(b, i, out, depth)
    out.append(b"]")
    return i


def _map(b: bytes, i: int, n: int, out: list[bytes], depth: int) -> int:
    pairs: list[tuple[bytes, bytes]] = []
    for _ in range(n):
        k: list[bytes] = []
        v: list[bytes] = []
        i = _key(b, i, k, depth)
        i = _key(b, i, v, depth)
        pairs.append((b"".join(k), b"".join(v)))
    names = [k for k, _ in pairs]
    # A string's text starts with '"' and no other key text does; equal strings have equal texts.
    if all(k[:1] == b'"' and k[1:2] != b"$" for k in names) and len(set(names)) == len(names):
        out += (b"{", b",".join(k + b":" + v for k, v in pairs), b"}")
    else:
        out += (b'{"$map":[', b",".join(b"[" + k + b"," + v + b"]" for k, v in pairs), b"]}")
    return i


def _double(bits: int) -> bytes:
    if (bits >> 52) & 0x7FF != 0x7FF:
        return _json.encode(struct.unpack(">d", bits.to_bytes(8, "big"))[0])
    if bits & ((1 << 52) - 1) == 0:
        return b'{"$float":"-Infinity"}' if bits >> 63 else b'{"$float":"Infinity"}'
    if bits == _NAN:
        return b'{"$float":"NaN"}'
    return b'{"$float":"NaN:%016x"}' % bits


def _float32(bits: int) -> bytes:
    """A float32 is the double it equals (the node writes doubles only); a NaN's bits widened as they are."""
    if (bits >> 23) & 0xFF != 0xFF:
        return _json.encode(struct.unpack(">f", bits.to_bytes(4, "big"))[0])
    sign, mantissa = bits >> 31, bits & ((1 << 23) - 1)
    return _double((sign << 63) | (0x7FF << 52) | (mantissa << 29))


def _ext(code: int, data: bytes) -> bytes:
    if code == -1:
        text = _timestamp(data)
        if text is not None:
            return b'{"$date":"' + text + b'"}'
    return b'{"$ext":[%d,"' % code + base64.b64encode(data) + b'"]}'


def _timestamp(data: bytes) -> bytes | None:
    """A MessagePack timestamp as RFC 3339 UTC text, None if it is not a valid one a datetime holds."""
    if len(data) == 4:
        seconds, nanos = int.from_bytes(data, "big"), 0
    elif len(data) == 8:
        v = int.from_bytes(data, "big")
        seconds, nanos = v & ((1 << 34) - 1), v >> 34
    elif len(data) == 12:
        nanos, seconds = int.from_bytes(data[:4], "big"), int.from_bytes(data[4:], "big", signed=True)
    else:
        return None
    if nanos >= 10**9 or not _SECONDS_MIN <= seconds <= _SECONDS_MAX:
        return None
    d = _EPOCH + timedelta(seconds=seconds)
    fraction = "" if nanos == 0 else f".{nanos // 1000:06d}" if nanos % 1000 == 0 else f".{nanos:09d}"
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}T{d.hour:02d}:{d.minute:02d}:{d.second:02d}{fraction}Z".encode()
