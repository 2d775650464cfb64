"""Opening a node's WAL after a stop or a crash: replay from the last checkpoint.

Replay rebuilds the dirty map (everything newer than the page store), the cache registry and
the version counter, finishes archiving of segments that were closed but not yet moved, and
truncates a torn tail of the active segment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import structlog

from cdcd.node.store import CheckpointMeta, cache_prefix
from cdcd.wal.pointer import WalPointer
from cdcd.wal.reader import WalReader
from cdcd.wal.records import CacheInfo, CacheOp, CacheRecord, DataEntry, DataRecord
from cdcd.wal.segment import HEADER_SIZE, list_segments

log = structlog.get_logger("cdcd.node.recovery")


class RecoveredState:
    def __init__(self) -> None:
        self.dirty: dict[bytes, DataEntry] = {}
        self.caches: dict[str, CacheInfo] = {}
        self.next_order = 1
        self.records = 0
        self.position = WalPointer(0, 0)
        """Where the writer continues: offset 0 means a new segment (header to write)."""
        self.closed_segments: list[tuple[int, Path]] = []
        """Closed segments still in the work dir, to archive before writing."""


def recover(
    *,
    work_dir: Path,
    archive_dir: Path,
    checkpoint: CheckpointMeta | None,
    caches: dict[str, CacheInfo],
    purge_cache: Callable[[CacheInfo], None],
    read_only: bool = False,
) -> RecoveredState:
    """``read_only``: change nothing on disk (no tail truncation); for inspecting a stopped node."""
    state = RecoveredState()
    state.caches = dict(caches)
    if checkpoint is not None:
        state.next_order = checkpoint.next_order
    work, refused = list_segments(work_dir)
    for path in refused:
        if path == archive_dir:
            continue
        log.warning("foreign_file_in_wal_dir", path=str(path))
    archived, _ = list_segments(archive_dir)
    active = max(work) if work else None
    start = checkpoint.pointer if checkpoint is not None else None
    reader = WalReader([work_dir, archive_dir], start, active_segment=active)
    by_id = {info.cache_id: info for info in state.caches.values()}
    dirty = state.dirty
    order = state.next_order - 1
    for _ptr, record in reader:
        state.records += 1
        if type(record) is DataRecord:
            for e in record.entries:
                info = by_id.get(e.cache_id)
                if info is None:
                    continue  # cache destroyed later in the log; its DESTROY purges anyway
                dirty[cache_prefix(e.cache_id) + e.key] = e
                order = max(order, e.version.order)
        elif type(record) is CacheRecord:
            if record.op == CacheOp.CREATE:
                info = CacheInfo(record.cache_id, record.name, record.config)
                state.caches[record.name] = info
                by_id[record.cache_id] = info
            else:
                prefix = cache_prefix(record.cache_id)
                for key in [k for k in dirty if k.startswith(prefix)]:
                    del dirty[key]
                gone = by_id.pop(record.cache_id, None) or CacheInfo(record.cache_id, record.name, record.config)
                state.caches.pop(record.name, None)
                purge_cache(gone)
    state.next_order = order + 1

    last = reader.last_reader
    if active is None:
        nxt = max(archived) + 1 if archived else 0
        state.position = WalPointer(nxt, 0)
    elif last is not None and last.segment == active:
        for idx in sorted(work):
            if idx != active:
                state.closed_segments.append((idx, work[idx]))
        if last.ended:
            state.closed_segments.append((active, work[active]))
            state.position = WalPointer(active + 1, 0)
        else:
            end = last.end_offset
            size = work[active].stat().st_size
            if size > end and not read_only:
                log.warning(
                    "wal_tail_truncated",
                    path=str(work[active]),
                    offset=end,
                    bytes_dropped=size - end,
                    torn_record=last.torn_tail,
                )
                with open(work[active], "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
            state.position = WalPointer(active, max(end, HEADER_SIZE))
            if end < HEADER_SIZE:
                state.position = WalPointer(active, 0)
    else:
        # The checkpoint lies beyond the active work segment: it cannot have been read.
        raise RuntimeError(f"checkpoint {start} is past the active WAL segment {active} in {work_dir}")
    return state
