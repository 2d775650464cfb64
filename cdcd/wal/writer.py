"""Appending records: the in-memory append buffer and the segment files it is flushed to.

``WalWriter`` is not thread-safe; the node serialises ``append``/``roll``/``take`` under its lock
and lets a single flusher thread call ``SegmentFiles.write``.
"""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from cdcd.durable import fsync_dir
from cdcd.wal.errors import WalDiskFull
from cdcd.wal.frame import FRAME_HEADER, FRAME_HEADER_SIZE, SEGMENT_END_FRAME, frame_crc
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import Record
from cdcd.wal.segment import HEADER_SIZE, encode_header, segment_path

PAGE_SIZE = mmap.PAGESIZE
_END_SIZE = len(SEGMENT_END_FRAME)
_HEADER_PLACEHOLDER = bytes(FRAME_HEADER_SIZE)
_encoder = msgspec.msgpack.Encoder()
_pack_header = FRAME_HEADER.pack
_crc32 = frame_crc


def page_round_up(n: int) -> int:
    return max(PAGE_SIZE, -(-n // PAGE_SIZE) * PAGE_SIZE)


class RecordTooLarge(ValueError):
    pass


class Chunk:
    """Contiguous bytes of one segment, starting at ``offset``; ``ends_segment`` if they close it."""

    __slots__ = ("data", "ends_segment", "offset", "segment")

    def __init__(self, segment: int, offset: int, data: bytearray) -> None:
        self.segment = segment
        self.offset = offset
        self.data = data
        self.ends_segment = False

    @property
    def start(self) -> WalPointer:
        return WalPointer(self.segment, self.offset)

    @property
    def end(self) -> WalPointer:
        return WalPointer(self.segment, self.offset + len(self.data))

    def __repr__(self) -> str:
        return f"Chunk({self.start}+{len(self.data)}{', end' if self.ends_segment else ''})"


class WalWriter:
    """Places framed records into segments and buffers them until the flusher takes them.

    The buffer holds whole pages (``buffer_bytes`` rounded up to the page size); ``buffered_bytes``
    lets the caller apply back-pressure when it is full. A segment is rolled before a record that
    would not fit together with the closing SegmentEnd record.
    """

    def __init__(self, node_id: uuid.UUID, segment_size_bytes: int, buffer_bytes: int, position: WalPointer) -> None:
        if segment_size_bytes < HEADER_SIZE + 2 * len(SEGMENT_END_FRAME) + 64:
            raise ValueError(f"wal_segment_size_bytes too small: {segment_size_bytes}")
        self.node_id = node_id
        self.segment_size_bytes = segment_size_bytes
        self.buffer_bytes = page_round_up(buffer_bytes)
        self._segment = position.segment
        self._offset = position.offset
        self._chunks: list[Chunk] = []
        self._buffered = 0
        self._current: Chunk | None = None
        if self._offset == 0:
            self._open_segment(self._segment)

    @property
    def position(self) -> WalPointer:
        """Where the next record will be placed (before any roll it may trigger)."""
        return WalPointer(self._segment, self._offset)

    @property
    def segment(self) -> int:
        return self._segment

    @property
    def segment_has_records(self) -> bool:
        return self._offset > HEADER_SIZE

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def _open_segment(self, segment: int) -> None:
        self._segment = segment
        self._offset = 0
        self._write(encode_header(segment, self.node_id))

    def _write(self, data: bytes) -> None:
        cur = self._current
        if cur is None or cur.segment != self._segment:
            cur = Chunk(self._segment, self._offset, bytearray())
            self._chunks.append(cur)
            self._current = cur
        cur.data += data
        self._offset += len(data)
        self._buffered += len(data)

    def append_record(self, record: Record) -> WalPointer:
        """Encode and frame ``record`` into the buffer; returns its pointer."""
        offset = self.place(record)
        return WalPointer(self._segment, offset)

    def place(self, record: Record) -> int:
        """``append_record`` without the pointer: returns the record's offset in ``segment`` (read
        after the call: placing may roll)."""
        payload = _encoder.encode(record)
        size = FRAME_HEADER_SIZE + len(payload)
        offset = self._offset
        if offset + size + _END_SIZE > self.segment_size_bytes:
            if HEADER_SIZE + size + _END_SIZE > self.segment_size_bytes:
                raise RecordTooLarge(
                    f"record of {size} bytes does not fit in a segment of wal_segment_size_bytes="
                    f"{self.segment_size_bytes}"
                )
            self.roll()
            offset = self._offset
        cur = self._current
        if cur is None or cur.segment != self._segment:
            cur = Chunk(self._segment, offset, bytearray())
            self._chunks.append(cur)
            self._current = cur
        # One append of header + payload: a second bytearray append cost more than the concatenation.
        cur.data += _pack_header(len(payload), record.TYPE, _crc32(payload)) + payload
        self._offset = offset + size
        self._buffered += size
        return offset

    def roll(self) -> int:
        """Close the current segment with SegmentEnd and start the next; returns the closed index."""
        closed = self._segment
        self._write(SEGMENT_END_FRAME)
        assert self._current is not None
        self._current.ends_segment = True
        self._current = None
        self._open_segment(closed + 1)
        return closed

    def take(self) -> list[Chunk]:
        """Hand every buffered chunk to the flusher, in order."""
        chunks, self._chunks = self._chunks, []
        self._current = None
        self._buffered = 0
        return chunks


class SegmentFiles:
    """Writes chunks to segment files in the work dir and fsyncs them (flusher thread only).

    A segment closed by its SegmentEnd is fsynced and closed before any byte of the next one is
    written, so at most one segment in the work dir is ever incomplete.
    """

    def __init__(self, work_dir: Path, on_segment_closed: Callable[[int, Path], None], fsync: bool = True) -> None:
        self.work_dir = work_dir
        self.on_segment_closed = on_segment_closed
        self.fsync = fsync
        self._fd: int | None = None
        self._fd_segment = -1
        self.bytes_written = 0
        self.fsyncs = 0

    def _open(self, segment: int) -> int:
        path = segment_path(self.work_dir, segment)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if created and self.fsync:
            fsync_dir(self.work_dir)
        self._fd, self._fd_segment = fd, segment
        return fd

    def write(self, chunks: list[Chunk]) -> None:
        for done, chunk in enumerate(chunks):
            pos = chunk.offset
            try:
                fd = self._fd if self._fd_segment == chunk.segment else None
                if fd is None:
                    self.close()
                    fd = self._open(chunk.segment)
                view = memoryview(chunk.data)
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
            except OSError as exc:
                # Only a failed write or create is safe to repeat: after a failed fsync the kernel may
                # have dropped the dirty pages, so those errors stay fatal.
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise WalDiskFull(segment_path(self.work_dir, chunk.segment), pos, done, exc) from exc
                raise
            self.bytes_written += len(chunk.data)
            if chunk.ends_segment:
                self._sync(fd)
                self.close()
                self.on_segment_closed(chunk.segment, segment_path(self.work_dir, chunk.segment))
        if self._fd is not None and chunks and not chunks[-1].ends_segment:
            self._sync(self._fd)

    def _sync(self, fd: int) -> None:
        if self.fsync:
            os.fdatasync(fd)
            self.fsyncs += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd, self._fd_segment = None, -1
