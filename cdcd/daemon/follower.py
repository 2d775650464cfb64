"""Reading the CDC directory in strict segment order from a position, in bounded chunks."""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import structlog

from cdcd.wal.errors import MissingSegment
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import Record, SegmentEnd
from cdcd.wal.segment import list_segments

log = structlog.get_logger("cdcd.daemon")

ReadItem = tuple[WalPointer, Record, int, bytes | None]
"""(pointer, record, frame size in bytes, the record's payload as read: ``RecordSlice.payload``)."""

_ReadKey = tuple[int, int, frozenset[int], int]
"""(segment, offset, record types skipped, records at most): a read's chunk is the same for every
follower that asks for it."""


class SharedReads:
    """Decoded chunks, shared by the followers of one daemon's consumers: the first to reach a place
    reads and decodes it; the others take the same chunk (the same record objects) from here.

    Bounded by ``max_bytes`` of frames (oldest first out), never by a backlog: a follower further
    behind than what is kept reads from its own position, as a daemon of one consumer does. A
    follower that asks for a chunk another is reading waits for it rather than read it twice."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._chunks: OrderedDict[_ReadKey, tuple[list[ReadItem], str, int]] = OrderedDict()
        self._bytes = 0
        self._reading: dict[_ReadKey, threading.Event] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def take(self, key: _ReadKey) -> tuple[list[ReadItem], str] | None:
        """The chunk at ``key`` (and the node id of its segment), waiting while another follower reads
        it; None: not here, the caller reads it and must ``put`` or ``abandon`` it."""
        while True:
            with self._lock:
                found = self._chunks.get(key)
                if found is not None:
                    self.hits += 1
                    return found[0], found[1]
                reading = self._reading.get(key)
                if reading is None:
                    self._reading[key] = threading.Event()
                    self.misses += 1
                    return None
            reading.wait()

    def put(self, key: _ReadKey, chunk: list[ReadItem], node_id: str) -> None:
        size = sum(item[2] for item in chunk)
        with self._lock:
            done = self._reading.pop(key, None)
            if chunk and size <= self.max_bytes:
                self._chunks[key] = (chunk, node_id, size)
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, (_, _, dropped) = self._chunks.popitem(last=False)
                    self._bytes -= dropped
        if done is not None:
            done.set()

    def abandon(self, key: _ReadKey) -> None:
        """The read at ``key`` failed: whoever waits for it reads it itself."""
        with self._lock:
            done = self._reading.pop(key, None)
        if done is not None:
            done.set()


class SegmentFollower:
    """Yields records of consecutive segments in the CDC dir; ``None`` from ``read`` means "wait".

    Only regular files named ``%016d.wal`` are read: other names and symlinks are refused with a
    warning (once each) and never opened. A gap before a newer segment is ``MissingSegment``.
    A segment whose header names another node than ``expect_node_id`` is ``ForeignSegment``
    before any of its records is returned; without an expected id, the first segment read sets it.
    """

    def __init__(
        self,
        cdc_dir: Path,
        start: WalPosition | None,
        *,
        skip_types: frozenset[int] = frozenset(),
        expect_node_id: uuid.UUID | None = None,
        shared: SharedReads | None = None,
        lazy_entries: bool = False,
    ) -> None:
        """``shared``: chunks other followers of the same daemon decoded (a daemon of several consumers);
        ``lazy_entries``: DataRecords' entries left undecoded until read (``SegmentReader.lazy_entries``)."""
        self.cdc_dir = cdc_dir
        self.lazy_entries = lazy_entries
        self.shared = shared
        self.skip_types = skip_types
        self.expect_node_id = expect_node_id
        self._segment: int | None = start.segment if start is not None else None
        self._offset = start.offset if start is not None else 0
        self._reader: SegmentReader | None = None
        self._records: Iterator[tuple[WalPointer, Record, bytes]] | None = None
        self._warned: set[str] = set()
        self.node_id = ""
        """Node id from the header of the segment being read (the source of its events)."""

    @property
    def segment(self) -> int | None:
        """The segment being read (or awaited)."""
        return self._segment

    def scan(self) -> dict[int, Path]:
        """Segments present, refusing (and warning about) foreign files and symlinks."""
        found, refused = list_segments(self.cdc_dir)
        for path in refused:
            if path.name not in self._warned:
                self._warned.add(path.name)
                kind = "symlink" if path.is_symlink() else "not a regular segment file"
                log.warning("cdc_dir_file_ignored", path=str(path), reason=kind)
        return found

    def _open_next(self) -> bool:
        found = self.scan()
        if self._segment is None:
            if not found:
                return False
            self._segment, self._offset = min(found), 0
        seg = self._segment
        path = found.get(seg)
        if path is None:
            if any(s > seg for s in found):
                raise MissingSegment(self.cdc_dir, seg)
            return False
        self._reader = SegmentReader(
            path,
            start_offset=self._offset,
            archived=True,
            skip_types=self.skip_types,
            expect_node_id=self.expect_node_id,
            lazy_entries=self.lazy_entries,
        )
        self._records = self._reader.frames()
        return True

    def read(self, max_records: int) -> list[ReadItem] | None:
        """Up to ``max_records`` records; an empty list after a segment ended; None if nothing is there yet."""
        shared = self.shared
        if shared is None or self._segment is None:
            return self._read(max_records)
        key = (self._segment, self._offset, self.skip_types, max_records)
        found = shared.take(key)
        if found is not None:
            self._reader = self._records = None  # reopened at the new offset when this follower reads again
            self._passed(*found)
            return found[0]
        try:
            read = self._read(max_records)
        except BaseException:
            shared.abandon(key)
            raise
        if read:
            shared.put(key, read, self.node_id)
        else:
            shared.abandon(key)
        return read

    def _passed(self, chunk: list[ReadItem], node_id: str) -> None:
        """Move past ``chunk`` (read by another follower) as if this one had read it."""
        if not chunk:
            return
        self.node_id = node_id
        if self.expect_node_id is None and node_id:
            self.expect_node_id = uuid.UUID(node_id)
        ptr, record, size, _payload = chunk[-1]
        if type(record) is SegmentEnd:
            self._segment = ptr.segment + 1
            self._offset = 0
        else:
            self._segment = ptr.segment
            self._offset = ptr.offset + size

    def _read(self, max_records: int) -> list[ReadItem] | None:
        if self._records is None and not self._open_next():
            return None
        reader, records = self._reader, self._records
        assert reader is not None and records is not None
        out: list[ReadItem] = []
        append = out.append
        for ptr, record, payload in records:
            if not out and reader.header is not None:
                self.node_id = str(reader.header.node_id)
                if self.expect_node_id is None:
                    self.expect_node_id = reader.header.node_id
            append((ptr, record, reader.end_offset - ptr.offset, payload))
            if type(record) is SegmentEnd:
                self._reader = self._records = None
                assert self._segment is not None
                self._segment += 1
                self._offset = 0
                break
            if len(out) >= max_records:
                break
        if out and type(out[-1][1]) is not SegmentEnd:
            self._offset = out[-1][0].offset + out[-1][2]  # where this follower reads next (kept open)
        return out


def delete_links_below(cdc_dir: Path, segment: int) -> list[int]:
    """Delete links of segments with an index below ``segment``; returns the deleted indexes."""
    found, _ = list_segments(cdc_dir)
    deleted = []
    for idx in sorted(found):
        if idx >= segment:
            break
        try:
            os.unlink(found[idx])
        except FileNotFoundError:
            continue
        deleted.append(idx)
    return deleted
