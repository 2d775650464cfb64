"""Positions in the WAL."""

from __future__ import annotations

import msgspec


class WalPointer(msgspec.Struct, frozen=True, order=True, array_like=True, gc=False):
    """Offset of a record's first byte inside a numbered segment; ordered (segment, offset)."""

    segment: int
    offset: int

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}"

    @classmethod
    def parse(cls, text: str) -> WalPointer:
        """Parse ``SEG:OFF`` (the form ``str()`` prints); a bare ``SEG`` means its first record."""
        seg, sep, off = text.partition(":")
        try:
            segment = int(seg)
            offset = int(off) if sep else 0
        except ValueError:
            raise ValueError(f"bad WAL pointer {text!r}: expected SEGMENT:OFFSET, e.g. 42:1048576") from None
        if segment < 0 or offset < 0:
            raise ValueError(f"bad WAL pointer {text!r}: segment and offset must be >= 0")
        return cls(segment, offset)


class WalPosition(msgspec.Struct, frozen=True, order=True, array_like=True, gc=False):
    """A resume cursor: everything before it is done, ``(segment, offset, entry_index)``.

    One DataRecord carries many entries, so a pointer alone cannot say how far a consumer got
    inside it; ``entry_index`` is the number of entries of that record already delivered (of any
    other record: 1 once it is passed). An event's own place is an ``EventAddress``; compare the
    two with ``entries_done`` and ``covers``, never as raw tuples.
    """

    segment: int
    offset: int
    entry_index: int = 0

    @property
    def pointer(self) -> WalPointer:
        return WalPointer(self.segment, self.offset)

    def entries_done(self, ptr: WalPointer, entries: int) -> int:
        """How many of the ``entries`` entries of the record at ``ptr`` lie before this cursor:
        all of a record before it, ``entry_index`` of the record it points into, none after."""
        if ptr.segment != self.segment:
            return entries if ptr.segment < self.segment else 0
        if ptr.offset != self.offset:
            return entries if ptr.offset < self.offset else 0
        return min(self.entry_index, entries)

    def covers(self, address: EventAddress) -> bool:
        """The event at ``address`` is done (it lies before this cursor)."""
        return (address.segment, address.offset, address.entry_index) < (self.segment, self.offset, self.entry_index)

    @classmethod
    def parse(cls, text: str) -> WalPosition:
        """Parse ``SEG:OFF#IDX`` (the form ``str()`` prints); ``#IDX`` defaults to 0."""
        ptr_text, sep, idx = text.partition("#")
        try:
            entry_index = int(idx) if sep else 0
        except ValueError:
            entry_index = -1
        if entry_index < 0:
            raise ValueError(f"bad WAL position {text!r}: expected SEGMENT:OFFSET[#ENTRY], e.g. 42:1048576#3")
        ptr = WalPointer.parse(ptr_text)
        return cls(ptr.segment, ptr.offset, entry_index)

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}#{self.entry_index}"


class EventAddress(msgspec.Struct, frozen=True, order=True, array_like=True, gc=False):
    """Where one event is: entry ``entry_index`` of the record at ``(segment, offset)``."""

    segment: int
    offset: int
    entry_index: int

    @property
    def pointer(self) -> WalPointer:
        return WalPointer(self.segment, self.offset)

    def cursor(self) -> WalPosition:
        """The cursor at this event: everything before it is done, this event not yet."""
        return WalPosition(self.segment, self.offset, self.entry_index)

    def next_cursor(self) -> WalPosition:
        """The cursor right after this event: it and everything before it are done."""
        return WalPosition(self.segment, self.offset, self.entry_index + 1)

    def __str__(self) -> str:
        return f"{self.segment}:{self.offset}#{self.entry_index}"
