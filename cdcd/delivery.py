"""What the daemon and the node's realtime worker share: the position filter, the batcher, the
ACTIVE record dispatch and the delivery loop.

``slices_from`` drops what lies before a resume cursor (``WalPosition.entries_done`` decides per
record); ``Batcher`` turns WAL records into batches of events and cache changes, in WAL order,
hiding caches with ``cdc_enabled = false`` and those the consumer's cache filter leaves out (their
positions are passed all the same; they are never announced);
``feed_active`` is what the delivering side does with one record. These are pure logic.
``DeliveryLoop`` hands one batch to a consumer (Ignite's loop): each side passes its consumer
call, its ``commit(cursor)``, its stop check and its retry wait. It is also the one place where a
consumer's ``RetriableError`` is waited out, for every sink: the same events again, with backoff,
for up to the consumer's ``retry_timeout_s``; the cache calls (``on_cache_change``,
``on_cache_drop``) go through the same policy (``DeliveryLoop.cache_call``); and where a
``RefusedEvent`` splits the batch: the events before it, the refused one to the dead letters, the
events after it.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from cdcd import failpoints
from cdcd.consumer import (
    DEFAULT_RETRY_TIMEOUT_S,
    CacheDrop,
    CdcEvent,
    EventBatch,
    RecordSlice,
    RefusedEvent,
    RetriableError,
    enabled_slices,
)
from cdcd.logging import describe
from cdcd.retry import Backoff, Retry, RetryInterrupted, retry_until
from cdcd.wal.pointer import EventAddress, WalPointer, WalPosition
from cdcd.wal.records import CacheInfo, CacheOp, CacheRecord, DataRecord, Record, SegmentEnd

log = structlog.get_logger("cdcd.delivery")

T = TypeVar("T")

_cache_id = operator.attrgetter("cache_id")


def record_entries(record: Record) -> int:
    """How many "entries" a record has for positions: its data entries, or 1 for any other record."""
    return len(record.entries) if type(record) is DataRecord else 1


def cursor_after(ptr: WalPointer, record: Record) -> WalPosition:
    """The cursor once the record at ``ptr`` is done (a segment's end leads to the next segment)."""
    if type(record) is SegmentEnd:
        return WalPosition(ptr.segment + 1, 0, 0)
    return WalPosition(ptr.segment, ptr.offset, record_entries(record))


def slices_from(slices: Sequence[RecordSlice], cursor: WalPosition | None) -> list[RecordSlice]:
    """The parts of ``slices`` at or after ``cursor`` (what lies before it is a replay)."""
    if cursor is None:
        return list(slices)
    out = []
    for s in slices:
        done = cursor.entries_done(s.pointer, s.end)
        if done >= s.end:
            continue
        out.append(RecordSlice(s.pointer, s.record, done, s.stop) if done > s.start else s)
    return out


@dataclass(frozen=True)
class Batch:
    """Deliver ``events``; once confirmed, everything before ``end`` is committed."""

    events: EventBatch
    end: WalPosition
    size_bytes: int


@dataclass(frozen=True)
class CacheChange:
    """Tell the consumer about caches (before any event of theirs); commit up to ``end``.

    ``end`` None: a batch is open (a new cache does not cut it): the change is recorded with the
    batch's commit. ``quiet``: a cache with CDC off (or switched off): record ``created`` only."""

    end: WalPosition | None
    created: list[CacheInfo] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)
    quiet: bool = False
    drops: list[CacheDrop] = field(default_factory=list)
    """``destroyed`` with their DESTROY records' place, time and version."""


class Batcher:
    """Collects the events of DataRecords into a batch, closed at ``batch_max_events`` or
    ``batch_max_bytes``; a CacheRecord becomes a CacheChange. Only a destroy, or a new config of a
    cache already known, closes the open batch first: a new cache's events join the batch, and
    its CacheChange comes before it."""

    def __init__(
        self,
        *,
        position: WalPosition | None,
        caches: dict[int, CacheInfo],
        source_node: str,
        batch_max_events: int,
        batch_max_bytes: int,
        names: dict[int, str] | None = None,
        selected: Callable[[str], bool] | None = None,
    ) -> None:
        self.position = position
        self.selected = selected
        """The consumer's cache filter (``caches``/``exclude_caches``) on names; None: every cache."""
        """Next thing to process: everything fed before it is accounted for."""
        self.caches = caches
        self.names: dict[int, str] = names if names is not None else {cid: i.name for cid, i in caches.items()}
        """Cache names for the events (the daemon's registry, or the node's caches)."""
        self.disabled = {cid for cid, info in caches.items() if not self.delivers(info)}
        """Caches with ``cdc_enabled = false`` or filtered out; kept after a destroy (its entries before
        it stay hidden)."""
        self.source_node = source_node
        self.batch_max_events = batch_max_events
        self.batch_max_bytes = batch_max_bytes
        self.slices: list[RecordSlice] = []
        self.events = 0
        self._bytes = 0
        self.batch_started: float | None = None
        """Monotonic time the open batch got its first event (for ``batch_max_delay_ms``)."""

    def delivers(self, info: CacheInfo) -> bool:
        """Whether the consumer gets this cache's events (and hears of it)."""
        return info.config.cdc_enabled and (self.selected is None or self.selected(info.name))

    def data(self, ptr: WalPointer, record: DataRecord, done: int, size: int) -> Batch | None:
        """Add the entries ``done..`` of a DataRecord; returns the batch it fills, if any."""
        disabled = self.disabled
        if done or (disabled and not disabled.isdisjoint(map(_cache_id, record.entries))):
            parts = enabled_slices(ptr, record, done, disabled)
            added = sum(p.end - p.start for p in parts)
            self.slices.extend(parts)
        else:
            added = len(record.entries)
            self.slices.append(RecordSlice(ptr, record, 0))
        if added and self.batch_started is None:
            self.batch_started = time.monotonic()
        self.events += added
        self._bytes += size
        self.position = WalPosition(ptr.segment, ptr.offset, len(record.entries))
        if self.events >= self.batch_max_events or self._bytes >= self.batch_max_bytes:
            return self.close()
        return None

    def passed(self, ptr: WalPointer, record: Record) -> None:
        """Any record without events for the consumer: the position moves past it."""
        self.position = cursor_after(ptr, record)

    def cache_record(self, ptr: WalPointer, record: CacheRecord) -> list[Batch | CacheChange]:
        """The CacheChange of a CacheRecord, after the open batch if the record must cut it."""
        info = CacheInfo(record.cache_id, record.name, record.config)
        cid = record.cache_id
        out: list[Batch | CacheChange] = []
        known = self.caches.get(cid)
        if self.slices and (record.op != CacheOp.CREATE or (known is not None and known != info)):
            out.append(self.close(end=WalPosition(ptr.segment, ptr.offset, 0)))
        self.passed(ptr, record)
        end = None if self.slices else self.position
        if record.op == CacheOp.CREATE:
            # A CREATE of a known cache with another config changes it from here on; one the
            # consumer already knows as it is (announced at start) is not announced again.
            self.caches[cid] = info
            self.names[cid] = record.name
            if self.delivers(info):
                self.disabled.discard(cid)
                out.append(CacheChange(end, created=[info], quiet=known == info))
            else:
                self.disabled.add(cid)
                out.append(CacheChange(end, created=[info], quiet=True))
        elif cid in self.disabled:
            # Never announced, so never destroyed for the consumer; its registry row stays, so a
            # pass that starts before this record (a restart, a switch) still hides its entries.
            out.append(CacheChange(end))
        else:
            # Keep the name for events of this cache still in flight; the registry forgets it.
            self.caches.pop(cid, None)
            drop = CacheDrop(cid, record.name, ptr, record.ts_ns, record.version, self.source_node)
            out.append(CacheChange(end, destroyed=[cid], drops=[drop]))
        return out

    def restart(self, position: WalPosition | None) -> None:
        """Drop an open batch (never delivered) and go on from ``position``."""
        self.slices = []
        self.events = 0
        self._bytes = 0
        self.batch_started = None
        self.position = position

    def close(self, end: WalPosition | None = None) -> Batch:
        """Close the open batch (possibly empty: it then only advances the position)."""
        position = end or self.position
        assert position is not None
        batch = Batch(EventBatch(self.source_node, self.slices, self.names), position, self._bytes)
        self.slices = []
        self.events = 0
        self._bytes = 0
        self.batch_started = None
        return batch


def feed_active(batcher: Batcher, ptr: WalPointer, record: Record, done: int, size: int) -> list[Batch | CacheChange]:
    """The delivering side's handling of a record not (wholly) before its start: the entries
    ``done..`` of a DataRecord join the batch, a CacheRecord becomes a CacheChange, any other
    record only moves the position (markers are the caller's: they mean nothing to a batch)."""
    rtype = type(record)
    if rtype is DataRecord:
        batch = batcher.data(ptr, record, done, size)  # type: ignore[arg-type]
        return [batch] if batch is not None else []
    if rtype is CacheRecord:
        return batcher.cache_record(ptr, record)  # type: ignore[arg-type]
    batcher.passed(ptr, record)
    return []


RETRY_BACKOFF = Backoff(initial_ms=200, max_ms=5000, jitter=0.2)
"""Between attempts of a consumer that raised ``RetriableError``: quick at first (a blip), then
every few seconds (an outage); jittered so that daemons sharing a store do not retry in step."""

DeadLetter = Callable[[CdcEvent, str], object]
"""Sets a refused event aside durably (once per position), with the refusal's text."""


class EventRefused(Exception):
    """A consumer refused an event and there is nowhere to set it aside: the side fails with this line."""


def split_at(
    events: EventBatch, address: EventAddress
) -> tuple[EventBatch | None, RecordSlice, EventBatch | None] | None:
    """``events`` cut around the event at ``address``: (the events before it, its slice, the events
    after it; None where there are none); None if it is not in ``events``."""
    slices = events.peek_slices()
    for k, s in enumerate(slices):
        i = address.entry_index
        if s.pointer.segment != address.segment or s.pointer.offset != address.offset or not s.start <= i < s.end:
            continue
        before = [*slices[:k], RecordSlice(s.pointer, s.record, s.start, i)] if i > s.start else list(slices[:k])
        after = list(slices[k + 1 :])
        if i + 1 < s.end:
            after.insert(0, RecordSlice(s.pointer, s.record, i + 1, s.stop))
        node, names = events.source_node, events.cache_names
        return (
            EventBatch(node, before, names) if before else None,
            RecordSlice(s.pointer, s.record, i, i + 1),
            EventBatch(node, after, names) if after else None,
        )
    return None


Observe = Callable[[Sequence[RecordSlice], EventBatch, int, bool], None]
"""After each consumer call: the slices it took, the batch it was given, how many events it took,
and whether it confirmed (metrics, lag)."""


class DeliveryLoop:
    """Ignite's delivery loop over one batch, shared by the daemon and the realtime worker.

    ``on_events`` is the side's consumer call (it wraps the consumer's errors its own way);
    ``commit(cursor)`` makes everything before ``cursor`` the committed position; ``stopping()``
    tells whether the side is stopping (the rest of a batch is then not offered again: the side
    that goes on later starts from the last commit); ``retry_wait()`` is the side's retry policy,
    called before a batch of which the consumer took nothing is offered again.

    ``on_events`` raising ``RetriableError`` (passed through by the side's wrapper): the same events
    are offered again, as a fresh batch (what the failed call iterated does not count as taken),
    after ``pause(delay_s)`` (True: the side is stopping, ``deliver`` returns False) with
    ``RETRY_BACKOFF``; each step is one ``consumer_retrying`` line, then ``on_retry`` hears of it (the
    side's metric). Still failing ``retry_timeout_s`` after the
    first failure: ``RetriesExhausted`` (the side fails).

    ``on_events`` raising ``RefusedEvent``: the events before the refused one are offered again (and
    committed once confirmed), ``dead_letter`` sets the refused one aside, the position moves past
    it, and the events after it follow. A ``dead_letter`` that runs again for the same event (a
    crash before that commit) must not set it aside twice. No ``dead_letter`` (dead letters off):
    the events before it are delivered all the same, then ``EventRefused``, one line naming the
    position (the side fails).

    ``cache_call`` runs a consumer's cache call under the same retry policy (its own retry steps,
    lines and ``on_retry``), so that a cache created or dropped during an outage waits it out as a
    batch does."""

    def __init__(
        self,
        on_events: Callable[[EventBatch], bool],
        commit: Callable[[WalPosition], None],
        *,
        stopping: Callable[[], bool],
        retry_wait: Callable[[], None],
        observe: Observe | None = None,
        pause: Callable[[float], bool] | None = None,
        on_retry: Callable[[Retry], None] | None = None,
        retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_S,
        dead_letter: DeadLetter | None = None,
    ) -> None:
        self.on_events = on_events
        self.dead_letter = dead_letter
        self.commit = commit
        self.stopping = stopping
        self.retry_wait = retry_wait
        self.observe = observe
        self.pause = pause or self._sleep_unless_stopping
        self.on_retry = on_retry
        self.retry_timeout_s = retry_timeout_s
        self.unconfirmed = False
        """A call returned False: nothing after the last commit may be committed until one returns True."""

    def deliver(self, item: Batch) -> bool:
        """Deliver ``item`` until the consumer has taken all of it; False if stopping cut it short."""
        events: EventBatch | None = item.events
        assert events is not None
        if len(events) == 0:
            if not self.unconfirmed:
                self.commit(item.end)  # only the position moves (markers, CDC-off entries, segment ends)
            return True
        return self._deliver(events, item.end)

    def _deliver(self, events: EventBatch | None, end: WalPosition) -> bool:
        """``deliver`` of ``events``, of which everything before ``end`` is committed once all is taken."""
        while events is not None:
            # What the consumer did not pull goes to its next call, also from inside a record; a
            # True commits the position after what it took.
            try:
                offered = self._offer(events)
            except RefusedEvent as refused:
                done, events = self._set_aside(events, end, refused)
                if not done:
                    return False
                continue
            if offered is None:
                return False
            ok, events = offered
            taken, rest = events.split_taken()
            took = len(events) - (len(rest) if rest is not None else 0)
            if self.observe is not None:
                self.observe(taken, events, took, ok)
            if ok:
                self.unconfirmed = False
                self.commit(end if rest is None or rest.first is None else rest.first.cursor())
            else:
                self.unconfirmed = True  # the next confirmed call commits both
            if rest is not None and not took:
                if self.stopping():
                    return False
                self.retry_wait()
            events = rest
        return True

    def _set_aside(self, events: EventBatch, end: WalPosition, refused: RefusedEvent) -> tuple[bool, EventBatch | None]:
        """The events before the refused one delivered, it set aside: (False: stopping cut it short,
        the events after it)."""
        at = refused.position
        split = split_at(events, at)
        if split is None:
            first, last = events.first, events.last
            raise EventRefused(
                f"consumer refused the event at {at.cursor()}, which is not in the batch it was given "
                f"({first and first.cursor()} to {last and last.cursor()}): {refused.reason}"
            )
        before, one, after = split
        event = next(iter(EventBatch(events.source_node, [one], events.cache_names)))
        error = describe(refused).removeprefix(f"{type(refused).__name__}: ")
        # Everything before it is delivered either way: a restart meets the refused event first.
        if before is not None and not self._deliver(before, at.cursor()):
            return False, None
        if self.dead_letter is None:
            raise EventRefused(
                f"consumer refused the event at {at.cursor()} (cache {event.cache_name}): {error} "
                '(set [consumer] dead_letters = "on" to set such events aside)'
            )
        self.dead_letter(event, error)
        failpoints.hit("delivery.dead_letter.written")  # set aside, the position not yet past it
        log.warning("dead_letter", position=str(at.cursor()), cache=event.cache_name, error=error)
        if not self.unconfirmed:
            self.commit(end if after is None or after.first is None else after.first.cursor())
        return True, after

    def confirm(self) -> bool:
        """Before a switch: empty calls until the consumer confirms what it took unconfirmed;
        False if stopping cut it short."""
        while self.unconfirmed:
            try:
                offered = self._offer(EventBatch("", [], {}))
            except RefusedEvent as refused:
                raise EventRefused(
                    f"consumer refused the event at {refused.position.cursor()} in a call without events: "
                    f"{refused.reason}"
                ) from refused
            if offered is None:
                return False
            if offered[0]:
                self.unconfirmed = False
                return True
            if self.stopping():
                return False
            self.retry_wait()
        return True

    def _offer(self, events: EventBatch) -> tuple[bool, EventBatch] | None:
        """(what ``on_events`` returned, the batch the successful call was given); None: stopping
        cut the retries of a ``RetriableError`` short."""
        given = events
        attempts = 0

        def attempt() -> bool:
            nonlocal given, attempts
            if attempts:
                given = EventBatch(events.source_node, events.peek_slices(), events.cache_names)
            attempts += 1
            return self.on_events(given)

        try:
            ok = self._retried("on_events", attempt)
        except RetryInterrupted:
            return None
        return ok, given

    def cache_call(self, what: str, call: Callable[[], object]) -> bool:
        """``call()``, the consumer's cache call ``what`` (``on_cache_drop``, ...), with a
        ``RetriableError`` waited out as for a batch; False: stopping cut the retries short (the call
        did not succeed: the side must not move its position past it). Still failing after
        ``retry_timeout_s``: ``RetriesExhausted``."""
        failpoints.hit(f"delivery.{what}")  # a test stops the target here, before the first attempt
        try:
            self._retried(what, call)
        except RetryInterrupted:
            return False
        return True

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        def retrying(retry: Retry) -> None:
            self._retrying(what, retry)

        return retry_until(
            call,
            self.retry_timeout_s,
            RETRY_BACKOFF,
            retriable=(RetriableError,),
            wait=self.pause,
            on_retry=retrying,
        )

    def _retrying(self, what: str, retry: Retry) -> None:
        log.warning(
            "consumer_retrying",
            call=what,
            error=describe(retry.error),
            attempt=retry.attempt,
            retry_in_s=round(retry.retry_in_s, 3),
            failing_for_s=round(retry.failing_for_s, 1),
            retry_timeout_s=self.retry_timeout_s,
        )
        if self.on_retry is not None:
            self.on_retry(retry)

    def _sleep_unless_stopping(self, delay_s: float) -> bool:
        if self.stopping():
            return True
        time.sleep(delay_s)
        return self.stopping()
