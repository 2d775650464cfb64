"""Reading records from segment files, one segment or a whole directory from any pointer."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from cdcd.wal.errors import CorruptRecord, ForeignSegment, MissingSegment, NotARecordStart, TruncatedSegment
from cdcd.wal.frame import DECODERS, FRAME_HEADER, FRAME_HEADER_SIZE, decode_data_record, frame_crc
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import DataRecord, Record, SegmentEnd
from cdcd.wal.segment import HEADER_SIZE, SegmentHeader, decode_header, list_segments, parse_segment_name

DEFAULT_READ_BUFFER_BYTES = 1 << 20
_SEGMENT_END = SegmentEnd.TYPE
_DATA = DataRecord.TYPE


def _open_regular(path: Path) -> BinaryIO:
    """Open a segment for reading: never through a symlink, never blocking on a FIFO or device
    (``list_segments`` refuses those too, but a file can be swapped between listing and opening)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptRecord(path, 0, "is a symlink; segments are read only as regular files") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptRecord(path, 0, "is not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


class SegmentReader:
    """Iterates ``(WalPointer, record)`` over one segment file.

    ``archived=True``: the segment must end with a SegmentEnd record exactly at end of file;
    anything short of that is ``TruncatedSegment``. ``archived=False`` (the active segment): a
    short or all-zero frame at the tail is "no more data yet", and a frame with a bad CRC that
    reaches end of file is a torn write (``torn_tail`` is set; nothing past it is returned).
    Any other bad frame raises ``CorruptRecord``. Memory use is bounded by ``read_buffer_bytes``
    plus the largest record; a length field that points past end of file allocates nothing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        start_offset: int = 0,
        archived: bool = True,
        read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
        skip_types: frozenset[int] = frozenset(),
        expect_node_id: uuid.UUID | None = None,
        lazy_entries: bool = False,
    ) -> None:
        self.path = Path(path)
        self.lazy_entries = lazy_entries
        """DataRecords' entries checked but left undecoded until read (``frame.decode_data_record``): for a
        consumer that ships the records' bytes on rather than read entries one by one."""
        self.expect_node_id = expect_node_id
        """When set, a header naming another node is ``ForeignSegment`` before any record is read."""
        self.segment = parse_segment_name(self.path)
        self.start_offset = start_offset
        self.archived = archived
        self.read_buffer_bytes = max(read_buffer_bytes, FRAME_HEADER_SIZE)
        self.skip_types = skip_types
        self.header: SegmentHeader | None = None
        self.end_offset = 0
        """Offset just past the last good record (where an active segment's next record goes)."""
        self.ended = False
        """True once SegmentEnd was read."""
        self.torn_tail = False

    def __iter__(self) -> Iterator[tuple[WalPointer, Record]]:
        for ptr, record, _payload in self.frames():
            yield ptr, record

    def frames(self) -> Iterator[tuple[WalPointer, Record, bytes]]:
        """Like iterating the reader, with each record's payload: the MessagePack bytes it was decoded
        from (CRC checked), which its keys and values (``msgspec.Raw``) point into already, so keeping
        it costs no copy. A consumer that ships records on (the lake's Spark tasks) sends these bytes
        instead of encoding the record again (``RecordSlice.payload``)."""
        path, segment = self.path, self.segment
        with _open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if not self.archived and size < HEADER_SIZE:
                return  # created, header not written yet: an empty active segment
            self.header = decode_header(f.read(HEADER_SIZE), path, segment)
            expect = self.expect_node_id
            if expect is not None and self.header.node_id != expect:
                what = f"segment of node {self.header.node_id}, not of this node {expect} (copied from another node?)"
                raise ForeignSegment(path, 0, what)
            pos = max(self.start_offset, HEADER_SIZE)
            if pos > size:
                raise CorruptRecord(path, pos, f"start offset is past end of file ({size} bytes)")
            f.seek(pos)
            self.end_offset = pos
            buf = b""
            bpos = 0
            base = pos  # file offset of buf[0]
            read_size = self.read_buffer_bytes
            decoders = DECODERS
            skip = self.skip_types
            lazy = self.lazy_entries
            unpack = FRAME_HEADER.unpack_from
            crc32 = frame_crc
            while True:
                off = base + bpos
                if len(buf) - bpos < FRAME_HEADER_SIZE:
                    buf = buf[bpos:] + f.read(read_size)
                    base, bpos = off, 0
                    if len(buf) < FRAME_HEADER_SIZE:
                        if self.archived:
                            raise TruncatedSegment(
                                path, off, f"segment ends after {size} bytes without a SegmentEnd record"
                            )
                        return
                length, rtype, crc = unpack(buf, bpos)
                frame_end = off + FRAME_HEADER_SIZE + length
                if length == 0 and rtype == 0 and not self.archived:
                    return  # zero-filled tail of the active segment
                if frame_end > size:
                    if self.archived:
                        raise TruncatedSegment(
                            path,
                            off,
                            f"record of {length} bytes runs past end of file ({size} bytes); expected SegmentEnd",
                        )
                    return
                start = bpos + FRAME_HEADER_SIZE
                if start + length > len(buf):
                    buf = buf[bpos:] + f.read(max(read_size, FRAME_HEADER_SIZE + length - (len(buf) - bpos)))
                    base, bpos = off, 0
                    start = FRAME_HEADER_SIZE
                payload = buf[start : start + length]
                actual = crc32(payload)
                if actual != crc:
                    if not self.archived and frame_end == size:
                        self.torn_tail = True
                        return
                    raise CorruptRecord(
                        path, off, f"CRC mismatch in segment {segment}: expected {crc:#010x}, actual {actual:#010x}"
                    )
                decoder = decoders.get(rtype)
                if decoder is None:
                    raise CorruptRecord(path, off, f"unknown record type {rtype} (known: {sorted(decoders)})")
                if len(payload) < 2 or not (0x91 <= payload[0] <= 0x9F and payload[1] == rtype):
                    # The type byte is outside the CRC: a flipped one must not pass as another type
                    # (a skipped DataRecord) — every record is an array whose first item is its tag.
                    raise CorruptRecord(path, off, f"record type {rtype} does not match its payload's tag")
                bpos = start + length
                self.end_offset = frame_end
                if rtype == _SEGMENT_END and frame_end != size:
                    raise CorruptRecord(path, frame_end, f"{size - frame_end} bytes after SegmentEnd")
                if rtype in skip:
                    continue
                try:
                    record = decode_data_record(payload) if lazy and rtype == _DATA else decoder.decode(payload)
                except (msgspec.DecodeError, ValueError, RecursionError) as exc:
                    message = f"undecodable record of type {rtype}: {_decode_error(exc)}"
                    raise CorruptRecord(path, off, message) from None
                yield WalPointer(segment, off), record, payload
                if rtype == _SEGMENT_END:
                    self.ended = True
                    return


def check_record_start(path: str | os.PathLike[str], offset: int) -> int:
    """Check that ``offset`` is where a record of the segment file starts (or 0: its first record);
    returns that record's offset. Walks the frame headers only; ``NotARecordStart`` names the nearest
    record starts around a wrong offset."""
    path = Path(path)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        decode_header(f.read(HEADER_SIZE), path, parse_segment_name(path))
        if offset == 0:
            return HEADER_SIZE
        pos = HEADER_SIZE
        while pos < offset:
            f.seek(pos)
            head = f.read(FRAME_HEADER_SIZE)
            if len(head) < FRAME_HEADER_SIZE:
                break
            length, _rtype, _crc = FRAME_HEADER.unpack_from(head, 0)
            if length == 0 and _rtype == 0:
                break  # zero-filled tail of an active segment
            nxt = pos + FRAME_HEADER_SIZE + length
            if nxt > offset:
                raise NotARecordStart(path, offset, f"not a record boundary: records start at {pos} and {nxt}")
            pos = nxt
        if pos != offset:
            raise NotARecordStart(path, offset, f"past the last record, which starts before {pos} ({size} bytes)")
        return pos


class WalReader:
    """Iterates records from ``start`` across the segments found in ``dirs``, in index order.

    Every segment but ``active_segment`` must be complete (archived). A gap in the numbering
    raises ``MissingSegment``. Iteration ends at the end of the last segment present when it started.

    ``follow=True`` reads the dirs of a running node, which change meanwhile: every segment from
    ``active_segment`` on may be the active one (the node rolled after the caller listed its work
    dir); a segment moved from the work dir to the archive between listing and opening is looked
    up again; an active segment that was rolled while it was read (a newer segment appeared) is
    read on to its end, as archived, from where the read stopped.
    """

    def __init__(
        self,
        dirs: Iterable[str | os.PathLike[str]],
        start: WalPointer | None = None,
        *,
        active_segment: int | None = None,
        read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
        follow: bool = False,
    ) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.start = start
        self.active_segment = active_segment
        self.follow = follow
        self.read_buffer_bytes = read_buffer_bytes
        self.last_reader: SegmentReader | None = None

    def segments(self) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for d in self.dirs:
            segs, _refused = list_segments(d)
            for idx, p in segs.items():
                found.setdefault(idx, p)
        return found

    def __iter__(self) -> Iterator[tuple[WalPointer, Record]]:
        found = self.segments()
        if not found:
            return
        first = min(found) if self.start is None else self.start.segment
        last = max(found)
        if first > last:
            raise MissingSegment(self.dirs[0], first)
        seg = first
        offset = self.start.offset if self.start is not None else 0
        active_from = self.active_segment
        follow = self.follow
        while seg <= last:
            path = found.get(seg)
            if path is None and follow:
                found = self.segments()  # moved between the listings of two dirs?
                path = found.get(seg)
            if path is None:
                raise MissingSegment(self.dirs[0], seg)
            tolerant = active_from is not None and (seg >= active_from if follow else seg == active_from)
            reader = SegmentReader(
                path, start_offset=offset, archived=not tolerant, read_buffer_bytes=self.read_buffer_bytes
            )
            self.last_reader = reader
            try:
                yield from reader
            except FileNotFoundError:
                if not follow:
                    raise
                # Archived (renamed into another dir) between listing and opening: nothing was read.
                found = self.segments()
                moved = found.get(seg)
                if moved is None:
                    raise MissingSegment(self.dirs[0], seg) from None  # deleted meanwhile
                if moved == path:
                    raise
                continue
            if follow and tolerant and not reader.ended:
                found = self.segments()
                if not any(s > seg for s in found):
                    return  # the tail of the active segment: no more data yet
                # Rolled while it was read: its rest is there now, complete.
                offset = max(reader.end_offset, offset)
                active_from = seg + 1
                continue
            seg += 1
            offset = 0


def iter_chunk(
    data: bytes | bytearray, segment: int, offset: int, path: str = "<flushed chunk>"
) -> Iterator[tuple[WalPointer, Record, int]]:
    """Records of an in-memory chunk of whole frames that starts at ``segment:offset``.

    This is how the node's realtime worker reads what the flusher just wrote (a chunk starting at
    offset 0 begins with the segment header, which is skipped). Yields (pointer, record, frame size).
    """
    view = memoryview(data)
    pos = 0
    if offset == 0:
        pos = HEADER_SIZE
    end = len(view)
    unpack = FRAME_HEADER.unpack_from
    while pos < end:
        if end - pos < FRAME_HEADER_SIZE:
            raise TruncatedSegment(path, offset + pos, f"chunk of segment {segment} ends inside a frame header")
        length, rtype, crc = unpack(view, pos)
        start = pos + FRAME_HEADER_SIZE
        payload = view[start : start + length]
        off = offset + pos
        if len(payload) != length:
            raise TruncatedSegment(path, off, f"chunk of segment {segment} ends inside a record")
        if frame_crc(payload) != crc:
            raise CorruptRecord(path, off, f"CRC mismatch in segment {segment}")
        decoder = DECODERS.get(rtype)
        if decoder is None:
            raise CorruptRecord(path, off, f"unknown record type {rtype}")
        try:
            record = decoder.decode(bytes(payload))
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            raise CorruptRecord(path, off, f"undecodable record of type {rtype}: {_decode_error(exc)}") from None
        yield WalPointer(segment, off), record, FRAME_HEADER_SIZE + length
        pos = start + length


def _decode_error(exc: BaseException) -> str:
    """The decoder's message, its location cut short: msgspec names the path to a bad value, which in a
    damaged record nested a thousand levels deep is thousands of characters, and the error is one line."""
    text = str(exc)
    return text if len(text) <= _DECODE_ERROR_CHARS else text[: _DECODE_ERROR_CHARS - 1] + "…"


_DECODE_ERROR_CHARS = 200
