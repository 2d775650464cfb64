"""Typed WAL errors: each names the file, the offset and what was expected."""

from __future__ import annotations

import os

from cdcd.faults import ExitCode, Fault


class WalError(Fault, Exception):
    """Base of every WAL read/format error: a corrupt, truncated or foreign segment (exit 5)."""

    exit_code = ExitCode.BAD_WAL

    def __init__(self, path: str | os.PathLike[str] | None, offset: int | None, message: str) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.offset = offset
        self.message = message
        where = self.path or "<wal>"
        if offset is not None:
            where = f"{where} at offset {offset}"
        super().__init__(f"{where}: {message}")


class BadSegmentName(WalError):
    """A file name that is not ``%016d.wal``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, None, "not a WAL segment name (expected 16 digits + '.wal', e.g. 0000000000000042.wal)")


class BadSegmentHeader(WalError):
    """The fixed segment header is missing, has the wrong magic/version, or names another segment."""


class ForeignSegment(BadSegmentHeader):
    """A segment whose header names another node than the one being followed."""


class CorruptRecord(WalError):
    """A frame whose CRC, type or payload does not check out."""


class NotARecordStart(CorruptRecord):
    """A position given by the operator (``--from``, ``--to``) that is not where a record starts."""

    exit_code = ExitCode.BAD_INPUT


class TruncatedSegment(WalError):
    """An archived segment that ends before its SegmentEnd record."""


class WalDiskFull(WalError):
    """A segment write found no free space (ENOSPC/EDQUOT); ``done`` chunks were written before it.

    Writes are positional, so the flusher can write the rest again once space returns."""

    def __init__(self, path: str | os.PathLike[str], offset: int, done: int, cause: OSError) -> None:
        self.done = done
        super().__init__(path, offset, f"disk full ({os.strerror(cause.errno or 0)})")


class MissingSegment(WalError):
    """A gap in the segment sequence."""

    exit_code = ExitCode.MISSING_SEGMENT
    hint = (
        "links were lost; run `cdcd control relink-lost-segments`, "
        "or `cdcd control delete-lost-segment-links` and resend"
    )

    def __init__(self, directory: str | os.PathLike[str], segment: int) -> None:
        self.segment = segment
        super().__init__(directory, None, f"missing segment {segment}")
