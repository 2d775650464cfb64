"""Record framing: ``length u32 | type u8 | crc32(payload) u32 | payload`` (little endian)."""

from __future__ import annotations

import struct
import zlib

import msgspec

from cdcd.wal.records import RECORD_TYPES, Record, SegmentEnd

FRAME_HEADER = struct.Struct("<IBI")
FRAME_HEADER_SIZE = FRAME_HEADER.size

_encoder = msgspec.msgpack.Encoder()
DECODERS: dict[int, msgspec.msgpack.Decoder[Record]] = {
    t: msgspec.msgpack.Decoder(cls)
    for t, cls in RECORD_TYPES.items()  # type: ignore[misc]
}


def encode_frame(record: Record) -> bytes:
    """One framed record, ready to append."""
    buf = bytearray(FRAME_HEADER_SIZE)
    _encoder.encode_into(record, buf, FRAME_HEADER_SIZE)
    payload = memoryview(buf)[FRAME_HEADER_SIZE:]
    FRAME_HEADER.pack_into(buf, 0, len(payload), record.TYPE, zlib.crc32(payload))
    payload.release()
    return bytes(buf)


SEGMENT_END_FRAME = encode_frame(SegmentEnd())
