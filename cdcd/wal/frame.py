"""Record framing: ``length u32 | type u8 | crc32(payload) u32 | payload`` (little endian)."""

from __future__ import annotations

import os
import struct
import zlib
from types import ModuleType
from typing import cast

import msgspec

from cdcd.wal.records import RECORD_TYPES, DataEntry, DataRecord, LazyEntries, Record, SegmentEnd, encode_hook

FRAME_HEADER = struct.Struct("<IBI")
FRAME_HEADER_SIZE = FRAME_HEADER.size

_encoder = msgspec.msgpack.Encoder(enc_hook=encode_hook)
DECODERS: dict[int, msgspec.msgpack.Decoder[Record]] = {
    t: msgspec.msgpack.Decoder(cls)
    for t, cls in RECORD_TYPES.items()  # type: ignore[misc]
}


CRC_CHUNK_BYTES = 5 * 1024
"""``zlib.crc32`` lets go of the GIL for more than 5 KiB (CPython's zlibmodule), and taking it back waits out the
switch interval (5 ms) whenever another thread of the process is busy: a reader thread beside a consumer that works
in Python stalled once per large record, longer than the CRC takes by a hundredfold. Up to this size it keeps it."""


def frame_crc(payload: bytes | bytearray | memoryview) -> int:
    """CRC-32 of a frame's payload (zlib's), computed without letting go of the GIL (``CRC_CHUNK_BYTES``)."""
    size = len(payload)
    if size <= CRC_CHUNK_BYTES:
        return zlib.crc32(payload)
    crc = 0
    with memoryview(payload) as view:
        for start in range(0, size, CRC_CHUNK_BYTES):
            crc = zlib.crc32(view[start : start + CRC_CHUNK_BYTES], crc)
    return crc


def encode_frame(record: Record) -> bytes:
    """One framed record, ready to append."""
    buf = bytearray(FRAME_HEADER_SIZE)
    _encoder.encode_into(record, buf, FRAME_HEADER_SIZE)
    payload = memoryview(buf)[FRAME_HEADER_SIZE:]
    FRAME_HEADER.pack_into(buf, 0, len(payload), record.TYPE, frame_crc(payload))
    payload.release()
    return bytes(buf)


SEGMENT_END_FRAME = encode_frame(SegmentEnd())


class _DataRecordHead(msgspec.Struct, frozen=True, array_like=True, tag_field="t", tag=1, gc=False):
    """A DataRecord with its entries left as bytes: DataRecord's fields, in its order (a test holds them equal)."""

    entries: msgspec.Raw
    commit_ts_ns: int
    resend: bool = False


_head_decoder = msgspec.msgpack.Decoder(_DataRecordHead)

ENTRIES_ENV = "CDCD_WAL_ENTRIES"
"""``python`` makes this process check entries by decoding them (``decode_data_record`` then decodes them all at
once, as every other reader does) even where the C module is built: how the tests hold the two paths to each
other. Read once, at import."""


def _entries_module(choice: str) -> ModuleType | None:
    if choice == "python":
        return None
    if choice not in ("", "c"):
        raise ValueError(f"environment: {ENTRIES_ENV}={choice!r} is not 'c' or 'python'")
    try:
        import cdcd.wal._entries as module
    except ImportError:
        if choice == "c":
            raise ImportError(f"{ENTRIES_ENV}=c but cdcd.wal._entries is not built (make install)") from None
        return None
    return module


_c = _entries_module(os.environ.get(ENTRIES_ENV, ""))
"""The C check (cdcd/wal/_entries.c), or None where it is not built or ``$CDCD_WAL_ENTRIES=python``: then
``decode_data_record`` decodes the entries at once."""


LAZY_MIN_ENTRIES = 4
"""A record of fewer entries is decoded at once: checking them and keeping them undecoded costs more than decoding
them (a ``LazyEntries`` is an object the garbage collector tracks, one per record)."""


def decode_data_record(payload: bytes) -> DataRecord:
    """A DataRecord's payload with its entries checked but left undecoded (``LazyEntries``); raises what its
    decoder would (``msgspec.DecodeError``, ``ValueError``, ``RecursionError``) for a record it refuses."""
    # payload[2]: the entries' array header, after the record's own and its tag (a fixarray below 16 entries).
    if _c is None or len(payload) < 3 or 0x90 <= payload[2] < 0x90 + LAZY_MIN_ENTRIES:
        return cast(DataRecord, DECODERS[DataRecord.TYPE].decode(payload))
    head = _head_decoder.decode(payload)
    entries = LazyEntries(head.entries, _c.check(head.entries))
    return DataRecord(cast("tuple[DataEntry, ...]", entries), head.commit_ts_ns, head.resend)


def count_ops(entries: tuple[DataEntry, ...], start: int, stop: int | None, counts: dict[tuple[int, int], int]) -> bool:
    """Adds entries ``start..stop`` to ``counts`` (``(cache_id, op)`` -> entries) when they are still undecoded
    bytes (``LazyEntries``), without decoding them; False (nothing added): count them as the caller would."""
    lazy: object = entries  # a tuple to the type checker (DataRecord.entries), maybe not at run time
    if type(lazy) is not LazyEntries or lazy.decoded or _c is None:
        return False
    _c.count_ops(lazy.raw, start, -1 if stop is None else stop, counts)
    return True
