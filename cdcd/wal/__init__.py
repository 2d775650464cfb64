"""The write-ahead log: format, reader, writer (DESIGN §3)."""

from cdcd.wal.errors import (
    BadSegmentHeader,
    BadSegmentName,
    CorruptRecord,
    MissingSegment,
    TruncatedSegment,
    WalError,
)
from cdcd.wal.frame import encode_frame
from cdcd.wal.pointer import EventAddress, WalPointer, WalPosition
from cdcd.wal.reader import SegmentReader, WalReader
from cdcd.wal.records import (
    NIL,
    CacheConfig,
    CacheOp,
    CacheRecord,
    CacheVersion,
    Checkpoint,
    DataEntry,
    DataRecord,
    Op,
    RealtimeCdcRecord,
    Record,
    SegmentEnd,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)
from cdcd.wal.segment import HEADER_SIZE, is_segment_name, parse_segment_name, segment_name

__all__ = [
    "HEADER_SIZE",
    "NIL",
    "BadSegmentHeader",
    "BadSegmentName",
    "CacheConfig",
    "CacheOp",
    "CacheRecord",
    "CacheVersion",
    "Checkpoint",
    "CorruptRecord",
    "DataEntry",
    "DataRecord",
    "MissingSegment",
    "Op",
    "RealtimeCdcRecord",
    "Record",
    "SegmentEnd",
    "SegmentReader",
    "StopRealtimeCdcRecord",
    "TruncatedSegment",
    "TryStartRealtimeCdcRecord",
    "WalError",
    "WalPointer",
    "WalPosition",
    "EventAddress",
    "WalReader",
    "encode_frame",
    "is_segment_name",
    "parse_segment_name",
    "segment_name",
]
