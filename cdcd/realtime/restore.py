"""Reading back, at a restart, what the realtime worker must deliver before the flushed chunks begin."""

from __future__ import annotations

from dataclasses import dataclass

from cdcd.node.config import NodeConfig
from cdcd.realtime.machine import ReadBack
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import WalReader


@dataclass(frozen=True)
class Overflow:
    """More than the buffer holds lies between the two positions: realtime stops."""

    read_bytes: int


def read_back(
    config: NodeConfig, start: WalPosition, until: WalPointer, limit_bytes: int
) -> tuple[ReadBack, int] | Overflow:
    """The records from ``start``'s record up to ``until`` (excluded) and their size in bytes, read
    from the archive and the work dir; Overflow past ``limit_bytes``."""
    records: ReadBack = []
    total = 0
    resume = start.pointer
    last_ptr: WalPointer | None = None
    while True:
        reader = WalReader([config.archive_path, config.wal_path], resume, active_segment=until.segment)
        try:
            for ptr, record in reader:
                if ptr >= until:
                    break
                if last_ptr is not None and ptr <= last_ptr:
                    continue  # read before the segment moved
                size = (reader.last_reader.end_offset - ptr.offset) if reader.last_reader else 0
                total += size
                if total > limit_bytes:
                    return Overflow(total)
                records.append((ptr, record, size))
                last_ptr = ptr
            return records, total
        except FileNotFoundError:
            # The flusher archived the segment being read (wal/N.wal -> wal/archive/): read on from there.
            resume = last_ptr if last_ptr is not None else start.pointer
