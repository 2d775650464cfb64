"""The daemon's state machine over WAL records: turns records into ordered work items.

Pure logic, no I/O: the pipeline feeds it records and carries out the items it emits, in order.
ACTIVE: DataRecords become batches; a TryStartRealtimeCdcRecord ends the pass with a switch to
PASSIVE. PASSIVE: only markers matter; RealtimeCdcRecord commits the node's position,
StopRealtimeCdcRecord ends the pass with a switch to ACTIVE at the node's last position.
Entries of caches with ``cdc_enabled = false`` never enter a batch (their positions are passed
all the same), and the consumer never hears of such a cache.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import structlog

from cdcd.consumer import EventBatch, RecordSlice, enabled_slices
from cdcd.daemon.state import Mode
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import (
    CacheInfo,
    CacheOp,
    CacheRecord,
    DataRecord,
    RealtimeCdcRecord,
    Record,
    SegmentEnd,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)

log = structlog.get_logger("cdcd.daemon")

_cache_id = operator.attrgetter("cache_id")


@dataclass(frozen=True)
class Batch:
    """Deliver ``events``; once confirmed, everything before ``end`` is committed."""

    events: EventBatch
    end: WalPosition
    size_bytes: int


@dataclass(frozen=True)
class CacheChange:
    """Tell the consumer about caches (before any event of theirs); commit up to ``end``.

    ``quiet``: a cache with CDC off (or switched off): record ``created`` in the registry only."""

    end: WalPosition
    created: list[CacheInfo] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)
    quiet: bool = False


@dataclass(frozen=True)
class MarkerCommit:
    """PASSIVE: the node committed up to ``position``; make it ours and delete older links."""

    position: WalPosition


@dataclass(frozen=True)
class Switch:
    """End of a pass: persist ``mode`` at ``position`` (after committing everything before)."""

    mode: Mode
    position: WalPosition | None
    reason: str


Item = Batch | CacheChange | MarkerCommit | Switch


def record_entries(record: Record) -> int:
    """How many "entries" a record has for positions: its data entries, or 1 for any other record."""
    return len(record.entries) if type(record) is DataRecord else 1


class Processor:
    def __init__(
        self,
        *,
        mode: Mode,
        position: WalPosition | None,
        caches: dict[int, CacheInfo],
        source_node: str,
        batch_max_events: int,
        batch_max_bytes: int,
    ) -> None:
        self.mode = mode
        self.start = position
        self.floor = position
        """The committed position: a marker never moves the daemon behind it (DESIGN §5, crash rule)."""
        self.position = position
        """Next thing to process: everything fed before it is accounted for."""
        self.caches = caches
        self.names = {cid: info.name for cid, info in caches.items()}
        self.disabled = {cid for cid, info in caches.items() if not info.config.cdc_enabled}
        """Caches with ``cdc_enabled = false``; kept after a destroy (its entries before it stay hidden)."""
        self.source_node = source_node
        self.batch_max_events = batch_max_events
        self.batch_max_bytes = batch_max_bytes
        self._slices: list[RecordSlice] = []
        self._events = 0
        self._bytes = 0
        self.batch_started: float | None = None
        """Monotonic time the open batch got its first event (for ``batch_max_delay_ms``)."""
        self.finished = False

    @property
    def pending_events(self) -> int:
        return self._events

    def _already_done(self, ptr: WalPointer, record: Record) -> int:
        """Entries of this record delivered before the start position (all of them if before it)."""
        start = self.start
        if start is None or ptr.segment > start.segment:
            self.start = None  # past the start: no more checks
            return 0
        if (ptr.segment, ptr.offset) < (start.segment, start.offset):
            return record_entries(record)
        if (ptr.segment, ptr.offset) == (start.segment, start.offset):
            return start.entry_index
        self.start = None
        return 0

    def feed(self, ptr: WalPointer, record: Record, size: int) -> list[Item]:
        """Process one record; returns the items it completes, in order."""
        if self.finished:
            raise RuntimeError("processor fed after its pass finished")
        done = self._already_done(ptr, record) if self.start is not None else 0
        rtype = type(record)
        n = record_entries(record)
        if done >= n:
            return []
        out: list[Item] = []
        if rtype is DataRecord:
            if self.mode is Mode.ACTIVE:
                assert isinstance(record, DataRecord)
                parts = enabled_slices(ptr, record, done, self.disabled)
                if parts:
                    self._slices.extend(parts)
                    if self.batch_started is None:
                        self.batch_started = time.monotonic()
                    self._events += sum(p.end - p.start for p in parts)
                self._bytes += size
                self.position = WalPosition(ptr.segment, ptr.offset, n)
                if self._events >= self.batch_max_events or self._bytes >= self.batch_max_bytes:
                    out.append(self.close_batch())
                return out
            self.position = WalPosition(ptr.segment, ptr.offset, n)
            return out
        if rtype is SegmentEnd:
            self.position = WalPosition(ptr.segment + 1, 0, 0)
            return out
        self.position = WalPosition(ptr.segment, ptr.offset, 1)
        if rtype is CacheRecord:
            assert isinstance(record, CacheRecord)
            if self._slices:
                out.append(self.close_batch(end=WalPosition(ptr.segment, ptr.offset, 0)))
            out.append(self._cache_record(record, self.position))
        elif rtype is TryStartRealtimeCdcRecord:
            # The node rolled the segment right after this record and waits for its link to go.
            if self.mode is Mode.ACTIVE:
                if self._slices:
                    out.append(self.close_batch(end=WalPosition(ptr.segment, ptr.offset, 0)))
                out.append(Switch(Mode.PASSIVE, WalPosition(ptr.segment + 1, 0, 0), "try_start_realtime"))
                self.finished = True
            else:
                # Never delete links here: what lies before this record may not have been delivered
                # by anyone. A node always writes a Stop record before a new TryStart after a restart.
                log.warning("try_start_in_passive_mode", pointer=str(ptr))
        elif rtype is StopRealtimeCdcRecord:
            assert isinstance(record, StopRealtimeCdcRecord)
            if self.mode is Mode.PASSIVE:
                out.append(Switch(Mode.ACTIVE, self._not_behind(ptr, record.last), record.reason or "stop_realtime"))
                self.finished = True
        elif rtype is RealtimeCdcRecord:
            assert isinstance(record, RealtimeCdcRecord)
            if self.mode is Mode.PASSIVE:
                last = self._not_behind(ptr, record.last)
                assert last is not None
                self.floor = last
                out.append(MarkerCommit(last))
            else:
                log.warning(
                    "realtime_record_in_active_mode",
                    pointer=str(ptr),
                    last=str(record.last),
                    hint="the node says its realtime worker delivers while this daemon is ACTIVE",
                )
        return out

    def _not_behind(self, ptr: WalPointer, last: WalPosition | None) -> WalPosition | None:
        """``last`` of a marker, or the committed position if ``last`` is behind it.

        A node killed between writing a TryStart and persisting that it did restarts with its older
        realtime position and writes Stop(that position); the daemon, PASSIVE past the TryStart,
        already committed everything before it and deleted those links. Going back would re-read
        deleted segments; nothing between the two positions is undelivered."""
        floor = self.floor
        if last is None or floor is None or last >= floor:
            return last
        log.warning("marker_behind_committed_position", pointer=str(ptr), last=str(last), committed=str(floor))
        return floor

    def feed_many(self, chunk: list[tuple[WalPointer, Record, int]]) -> list[Item]:
        """``feed`` over a chunk, stopping after a switch; the loop for plain DataRecords is inlined
        because it runs once per record of the backlog."""
        out: list[Item] = []
        slices = self._slices
        active = self.mode is Mode.ACTIVE
        max_events, max_bytes = self.batch_max_events, self.batch_max_bytes
        disabled = self.disabled
        for ptr, record, size in chunk:
            if (
                active
                and self.start is None
                and type(record) is DataRecord
                and (not disabled or disabled.isdisjoint(map(_cache_id, record.entries)))
            ):
                n = len(record.entries)
                slices.append(RecordSlice(ptr, record, 0))
                if self.batch_started is None:
                    self.batch_started = time.monotonic()
                self._events += n
                self._bytes += size
                self.position = WalPosition(ptr.segment, ptr.offset, n)
                if self._events >= max_events or self._bytes >= max_bytes:
                    out.append(self.close_batch())
                    slices = self._slices
                continue
            out.extend(self.feed(ptr, record, size))
            slices = self._slices
            if self.finished:
                break
        return out

    def _cache_record(self, record: CacheRecord, end: WalPosition) -> CacheChange:
        info = CacheInfo(record.cache_id, record.name, record.config)
        cid = record.cache_id
        if record.op == CacheOp.CREATE:
            # A CREATE of a known cache with another config changes it from here on; one the
            # consumer already knows as it is (announced at start) is not announced again.
            known = self.caches.get(cid)
            self.caches[cid] = info
            self.names[cid] = record.name
            if record.config.cdc_enabled:
                self.disabled.discard(cid)
                return CacheChange(end, created=[info], quiet=known == info)
            self.disabled.add(cid)
            return CacheChange(end, created=[info], quiet=True)
        if cid in self.disabled:
            # Never announced, so never destroyed for the consumer; its registry row stays, so a
            # pass that starts before this record (a restart, a switch) still hides its entries.
            return CacheChange(end)
        # Keep the name for events of this cache still in flight; the registry forgets it.
        self.caches.pop(cid, None)
        return CacheChange(end, destroyed=[cid])

    def close_batch(self, end: WalPosition | None = None) -> Batch:
        """Close the open batch (possibly empty: it then only advances the position)."""
        position = end or self.position
        assert position is not None
        batch = Batch(EventBatch(self.source_node, self._slices, self.names), position, self._bytes)
        self._slices = []
        self._events = 0
        self._bytes = 0
        self.batch_started = None
        return batch
