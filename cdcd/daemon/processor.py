"""The daemon's state machine over WAL records: turns records into ordered work items.

Pure logic, no I/O: the pipeline feeds it records and carries out the items it emits, in order.
ACTIVE: DataRecords become batches; a TryStartRealtimeCdcRecord ends the pass with a switch to
PASSIVE. PASSIVE: only markers matter; RealtimeCdcRecord commits the node's position,
StopRealtimeCdcRecord ends the pass with a switch to ACTIVE at the node's last position.
Entries of caches with ``cdc_enabled = false`` never enter a batch (their positions are passed
all the same), and the consumer never hears of such a cache. Batches, cache changes and the
position filter are ``cdcd.delivery``'s, shared with the node's realtime worker.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from cdcd.daemon_state import CdcMode
from cdcd.delivery import Batch, Batcher, CacheChange, feed_active, record_entries
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import (
    CacheInfo,
    CacheRecord,
    DataRecord,
    RealtimeCdcRecord,
    Record,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)

__all__ = [
    "INITIAL_MODE",
    "Batch",
    "CacheChange",
    "Item",
    "MarkerCommit",
    "Processor",
    "Switch",
    "record_entries",
    "start_from_node",
]

log = structlog.get_logger("cdcd.daemon")

_cache_id = operator.attrgetter("cache_id")


@dataclass(frozen=True)
class MarkerCommit:
    """PASSIVE: the node committed up to ``position``; make it ours and delete older links."""

    position: WalPosition


@dataclass(frozen=True)
class Switch:
    """End of a pass: persist ``mode`` at ``position`` (after committing everything before)."""

    mode: CdcMode
    position: WalPosition | None
    reason: str
    delivered: WalPointer | None = None
    """To ACTIVE: the last data record the node's consumer confirmed (the Stop record's), which the
    daemon's consumer is asked about (``Consumer.resume_at``) before it delivers."""


Item = Batch | CacheChange | MarkerCommit | Switch


INITIAL_MODE = CdcMode.NODE_ACTIVE
"""The mode of a daemon without a state and without a node to ask, fresh or after ``state reset``: it
waits for the node to say who delivers. Every open of a node writes what settles it (a Stop record, or a
restored realtime worker's markers), while ACTIVE could deliver beside a node restoring realtime."""


def start_from_node(
    node_realtime_on: bool, node_position: WalPosition | None, oldest_link: int | None
) -> tuple[CdcMode, WalPosition | None]:
    """A daemon without state, once the node said who delivers: PASSIVE if its realtime worker
    delivers; otherwise ACTIVE from where that worker stopped, or from the oldest link (None) when
    that position's segment was consumed and unlinked already."""
    if node_realtime_on:
        return CdcMode.NODE_ACTIVE, None
    if node_position is not None and oldest_link is not None and node_position.segment < oldest_link:
        return CdcMode.DAEMON_ACTIVE, None
    return CdcMode.DAEMON_ACTIVE, node_position


class Processor:
    def __init__(
        self,
        *,
        mode: CdcMode,
        position: WalPosition | None,
        caches: dict[int, CacheInfo],
        source_node: str,
        batch_max_events: int,
        batch_max_bytes: int,
        selected: Callable[[str], bool] | None = None,
        markers: bool = True,
    ) -> None:
        """``markers`` False: a consumer the node's realtime worker never stands in for (one of several
        consumers of a daemon, not its ``realtime_consumer``): always ACTIVE, hand-over markers only move
        its position."""
        self.markers = markers
        self.mode = mode if markers else CdcMode.DAEMON_ACTIVE
        self.start = position
        """Records before it were delivered before this pass (the position filter)."""
        self.floor = position
        """The committed position: a marker never moves the daemon behind it (DESIGN §5, crash rule)."""
        self.batcher = Batcher(
            position=position,
            caches=caches,
            source_node=source_node,
            batch_max_events=batch_max_events,
            batch_max_bytes=batch_max_bytes,
            selected=selected,
        )
        self.caches = caches
        self.finished = False

    @property
    def position(self) -> WalPosition | None:
        """Next thing to process: everything fed before it is accounted for."""
        return self.batcher.position

    @property
    def source_node(self) -> str:
        return self.batcher.source_node

    @source_node.setter
    def source_node(self, node_id: str) -> None:
        self.batcher.source_node = node_id

    @property
    def pending_events(self) -> int:
        return self.batcher.events

    @property
    def batch_started(self) -> float | None:
        """Monotonic time the open batch got its first event (for ``batch_max_delay_ms``)."""
        return self.batcher.batch_started

    def feed(self, ptr: WalPointer, record: Record, size: int, payload: bytes | None = None) -> list[Item]:
        """Process one record (``payload``: its bytes as read, ``RecordSlice.payload``); returns the items
        it completes, in order."""
        if self.finished:
            raise RuntimeError("processor fed after its pass finished")
        n = record_entries(record)
        done = 0
        start = self.start
        if start is not None:
            done = start.entries_done(ptr, n)
            if ptr > start.pointer:
                self.start = None  # past the start: no more checks
            elif done >= n:
                return []
        rtype = type(record)
        batcher = self.batcher
        if rtype is DataRecord and self.mode is not CdcMode.DAEMON_ACTIVE:
            batcher.passed(ptr, record)
            return []
        if rtype is DataRecord or rtype is CacheRecord:
            return list(feed_active(batcher, ptr, record, done, size, payload=payload))
        out: list[Item] = []
        batcher.passed(ptr, record)
        if not self.markers:
            return out
        if rtype is TryStartRealtimeCdcRecord:
            # The node rolled the segment right after this record and waits for its link to go.
            if self.mode is CdcMode.DAEMON_ACTIVE:
                if batcher.slices:
                    out.append(batcher.close(end=WalPosition(ptr.segment, ptr.offset, 0)))
                out.append(Switch(CdcMode.NODE_ACTIVE, WalPosition(ptr.segment + 1, 0, 0), "try_start_realtime"))
                self.finished = True
            else:
                # Never delete links here: what lies before this record may not have been delivered
                # by anyone. A node always writes a Stop record before a new TryStart after a restart.
                log.warning("try_start_in_passive_mode", pointer=str(ptr))
        elif rtype is StopRealtimeCdcRecord:
            assert isinstance(record, StopRealtimeCdcRecord)
            if self.mode is CdcMode.NODE_ACTIVE:
                position = self._not_behind(ptr, record.last)
                reason = record.reason or "stop_realtime"
                out.append(Switch(CdcMode.DAEMON_ACTIVE, position, reason, record.delivered))
                self.finished = True
        elif rtype is RealtimeCdcRecord:
            assert isinstance(record, RealtimeCdcRecord)
            if self.mode is CdcMode.NODE_ACTIVE:
                floor = self.floor
                if record.last is not None and floor is not None and record.last < floor:
                    # Read again: a pass starts at the committed position, which is a later marker's ``last``
                    # and so lies before the markers written while the worker delivered it. Nothing new.
                    return out
                assert record.last is not None
                self.floor = record.last
                out.append(MarkerCommit(record.last))
            else:
                # A marker from before the node's realtime worker stopped (a restore larger than its
                # buffer, say): its Stop record handed what follows it to this daemon. Expected, no fault.
                log.info(
                    "daemon_delivers_after_realtime_stop",
                    pointer=str(ptr),
                    last=str(record.last),
                    hint="the node's realtime worker stopped; the daemon delivers what it did not",
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

    def feed_many(self, chunk: list[tuple[WalPointer, Record, int, bytes | None]]) -> list[Item]:
        """``feed`` over a chunk, stopping after a switch; the loop for plain DataRecords is inlined
        because it runs once per record of the backlog."""
        out: list[Item] = []
        batcher = self.batcher
        active = self.mode is CdcMode.DAEMON_ACTIVE
        disabled = batcher.disabled
        for ptr, record, size, payload in chunk:
            if (
                active
                and self.start is None
                and type(record) is DataRecord
                and (not disabled or disabled.isdisjoint(map(_cache_id, record.entries)))
            ):
                batch = batcher.data(ptr, record, 0, size, payload)  # type: ignore[arg-type]
                if batch is not None:
                    out.append(batch)
                continue
            out.extend(self.feed(ptr, record, size, payload))
            if self.finished:
                break
        return out

    def close_batch(self, end: WalPosition | None = None) -> Batch:
        """Close the open batch (possibly empty: it then only advances the position)."""
        return self.batcher.close(end)
