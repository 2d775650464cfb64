"""Reading the CDC directory in strict segment order from a position, in bounded chunks."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import structlog

from cdcd.wal.errors import MissingSegment
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import Record, SegmentEnd
from cdcd.wal.segment import list_segments

log = structlog.get_logger("cdcd.daemon")

ReadItem = tuple[WalPointer, Record, int]
"""(pointer, record, frame size in bytes)."""


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
    ) -> None:
        self.cdc_dir = cdc_dir
        self.skip_types = skip_types
        self.expect_node_id = expect_node_id
        self._segment: int | None = start.segment if start is not None else None
        self._offset = start.offset if start is not None else 0
        self._reader: SegmentReader | None = None
        self._records: Iterator[tuple[WalPointer, Record]] | None = None
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
        )
        self._records = iter(self._reader)
        return True

    def read(self, max_records: int) -> list[ReadItem] | None:
        """Up to ``max_records`` records; an empty list after a segment ended; None if nothing is there yet."""
        if self._records is None and not self._open_next():
            return None
        reader, records = self._reader, self._records
        assert reader is not None and records is not None
        out: list[ReadItem] = []
        append = out.append
        for ptr, record in records:
            if not out and reader.header is not None:
                self.node_id = str(reader.header.node_id)
                if self.expect_node_id is None:
                    self.expect_node_id = reader.header.node_id
            append((ptr, record, reader.end_offset - ptr.offset))
            if type(record) is SegmentEnd:
                self._reader = self._records = None
                assert self._segment is not None
                self._segment += 1
                self._offset = 0
                break
            if len(out) >= max_records:
                break
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
