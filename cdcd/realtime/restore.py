"""Reading back, at a restart, what the realtime worker must deliver before the flushed chunks begin."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from cdcd import metrics
from cdcd.node.config import NodeConfig
from cdcd.realtime.machine import ReadBack, RealtimeMachine, Restore
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import WalReader

log = structlog.get_logger("cdcd.realtime")


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


def restore_into(
    machine: RealtimeMachine, cv: threading.Condition, config: NodeConfig, work: Restore, limit_bytes: int
) -> int | None:
    """Carry out the machine's ``Restore``: the records read back (0 when more than the buffer holds
    lies between, so realtime stops), or None when reading failed and the caller must stop realtime."""
    try:
        got = read_back(config, work.start, work.until, limit_bytes)
    except Exception as exc:
        log.error("realtime_restore_failed", error=f"{type(exc).__name__}: {exc}", start=str(work.start))
        with cv:
            machine.restore_failed()
        return None
    with cv:
        if isinstance(got, Overflow):
            log.warning("realtime_restore_overflow", read_bytes=got.read_bytes, buffer_max_bytes=limit_bytes)
            machine.restore_overflowed()
            return 0
        records, total = got
        machine.restored(records, total)
    metrics.RT_RESTORED_RECORDS.set(len(records))
    last = str(records[-1][0]) if records else None
    log.info("realtime_restored", records=len(records), bytes=total, last=last)
    return len(records)
