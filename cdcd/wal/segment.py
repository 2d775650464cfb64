"""Segment files: names and the fixed header."""

from __future__ import annotations

import os
import re
import struct
import uuid
import zlib
from pathlib import Path

from cdcd.wal.errors import BadSegmentHeader, BadSegmentName

SEGMENT_SUFFIX = ".wal"
_NAME_RE = re.compile(r"^([0-9]{16})\.wal\Z")

MAGIC = b"CDCDWAL\x00"
FORMAT_VERSION = 1
# magic, format version, flags, segment index, node id (uuid bytes), CRC32 of the preceding bytes.
_HEADER = struct.Struct("<8sHHQ16sI")
HEADER_SIZE = _HEADER.size


def segment_name(segment: int) -> str:
    if not 0 <= segment < 10**16:
        raise ValueError(f"segment index out of range: {segment}")
    return f"{segment:016d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str | os.PathLike[str]) -> int:
    """Index of a segment file name; ``BadSegmentName`` for anything else."""
    m = _NAME_RE.match(os.path.basename(os.fspath(name)))
    if m is None:
        raise BadSegmentName(name)
    return int(m.group(1))


def is_segment_name(name: str) -> bool:
    return _NAME_RE.match(name) is not None


def segment_path(directory: str | os.PathLike[str], segment: int) -> Path:
    return Path(directory) / segment_name(segment)


def encode_header(segment: int, node_id: uuid.UUID) -> bytes:
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, segment, node_id.bytes, 0)[: HEADER_SIZE - 4]
    return body + struct.pack("<I", zlib.crc32(body))


class SegmentHeader:
    __slots__ = ("format_version", "node_id", "segment")

    def __init__(self, segment: int, node_id: uuid.UUID, format_version: int) -> None:
        self.segment = segment
        self.node_id = node_id
        self.format_version = format_version


def decode_header(data: bytes | memoryview, path: str | os.PathLike[str], expect_segment: int | None) -> SegmentHeader:
    """Check and decode a segment header; errors name the file and what was expected."""
    if len(data) < HEADER_SIZE:
        raise BadSegmentHeader(path, 0, f"header needs {HEADER_SIZE} bytes, file has {len(data)}")
    magic, version, _flags, segment, node_id, crc = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadSegmentHeader(path, 0, f"bad magic {magic!r}, expected {MAGIC!r}")
    actual = zlib.crc32(data[: HEADER_SIZE - 4])
    if crc != actual:
        raise BadSegmentHeader(path, 0, f"header CRC mismatch: expected {crc:#010x}, actual {actual:#010x}")
    if version != FORMAT_VERSION:
        raise BadSegmentHeader(path, 0, f"unsupported format version {version}, expected {FORMAT_VERSION}")
    if expect_segment is not None and segment != expect_segment:
        raise BadSegmentHeader(path, 0, f"header says segment {segment}, file name says {expect_segment}")
    return SegmentHeader(segment, uuid.UUID(bytes=node_id), version)


def list_segments(directory: str | os.PathLike[str]) -> tuple[dict[int, Path], list[Path]]:
    """Regular, non-symlink segment files of a directory by index, plus the names that were refused.

    Symlinks and non-regular files are refused (never followed or opened), as are names that are
    not ``%016d.wal``; temp files ending in ``.tmp`` are skipped silently.
    """
    found: dict[int, Path] = {}
    refused: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found, refused
    for entry in entries:
        if entry.name.endswith(".tmp"):
            continue
        m = _NAME_RE.match(entry.name)
        if m is None or entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            refused.append(Path(entry.path))
            continue
        found[int(m.group(1))] = Path(entry.path)
    return found, refused
