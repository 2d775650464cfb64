"""What the daemon and the node's realtime worker share: the position filter, the batcher, the
ACTIVE record dispatch and the delivery loop.

``slices_from`` drops what lies before a resume cursor (``WalPosition.entries_done`` decides per
record); ``Batcher`` turns WAL records into batches of events and cache changes, in WAL order,
hiding caches with ``cdc_enabled = false`` and those the consumer's cache filter leaves out (their
positions are passed all the same; they are never announced);
``feed_active`` is what the delivering side does with one record. These are pure logic.
``DeliveryLoop`` delivers to one consumer (Ignite's loop), for either side (``Side``: how it calls,
commits and waits): batches, cache changes, a ``RetriableError`` waited out with backoff for up to
the consumer's ``retry_timeout_s`` (``DeliveryPolicy``), a ``RefusedEvent`` split out of its batch
to the dead letters; whatever fails for good is one ``DeliveryFailed``.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import structlog

from cdcd import failpoints
from cdcd.consumer import (
    CacheDrop,
    CdcEvent,
    Consumer,
    DeliveryPolicy,
    EventBatch,
    RecordSlice,
    RefusedEvent,
    RetriableError,
    enabled_slices,
)
from cdcd.logging import describe
from cdcd.retry import Backoff, RetriesExhausted, Retry, RetryInterrupted, retry_until
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
        out.append(RecordSlice(s.pointer, s.record, done, s.stop, s.payload) if done > s.start else s)
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

    def data(
        self, ptr: WalPointer, record: DataRecord, done: int, size: int, payload: bytes | None = None
    ) -> Batch | None:
        """Add the entries ``done..`` of a DataRecord; returns the batch it fills, if any. ``payload``:
        the record's bytes as read (``RecordSlice.payload``), when the reader kept them."""
        disabled = self.disabled
        if done or (disabled and not disabled.isdisjoint(map(_cache_id, record.entries))):
            parts = enabled_slices(ptr, record, done, disabled, payload)
            added = sum(p.end - p.start for p in parts)
            self.slices.extend(parts)
        else:
            added = len(record.entries)
            self.slices.append(RecordSlice(ptr, record, 0, None, payload))
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


def feed_active(
    batcher: Batcher, ptr: WalPointer, record: Record, done: int, size: int, *, payload: bytes | None = None
) -> list[Batch | CacheChange]:
    """The delivering side's handling of a record not (wholly) before its start: the entries
    ``done..`` of a DataRecord join the batch, a CacheRecord becomes a CacheChange, any other
    record only moves the position (markers are the caller's: they mean nothing to a batch).
    ``payload``: the record's bytes as read, if kept (``RecordSlice.payload``)."""
    rtype = type(record)
    if rtype is DataRecord:
        batch = batcher.data(ptr, record, done, size, payload)  # type: ignore[arg-type]
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
        p = s.payload
        before = [*slices[:k], RecordSlice(s.pointer, s.record, s.start, i, p)] if i > s.start else list(slices[:k])
        after = list(slices[k + 1 :])
        if i + 1 < s.end:
            after.insert(0, RecordSlice(s.pointer, s.record, i + 1, s.stop, p))
        node, names = events.source_node, events.cache_names
        return (
            EventBatch(node, before, names) if before else None,
            RecordSlice(s.pointer, s.record, i, i + 1, p),
            EventBatch(node, after, names) if after else None,
        )
    return None


class Side(Protocol):
    """What one deliverer (the daemon's ``Committer``, the node's realtime ``Deliverer``) brings to a
    ``DeliveryLoop``; the loop does the rest: the consumer's calls, retries, dead letters, cache changes."""

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run the consumer's call ``what`` (``on_events``, ``on_cache_change``, ...): ``fn()``, with
        whatever the side does around it (the daemon asks ``alive()`` first and times it). What it
        raises, the loop sorts out."""
        ...

    def commit(self, end: WalPosition) -> None:
        """The consumer confirmed everything before ``end``: make it the committed position."""
        ...

    def wait(self, delay_s: float, retrying: bool = False) -> bool:
        """Wait up to ``delay_s`` unless stopping; True: stopping (``wait(0)`` only asks). ``retrying``:
        a ``RetriableError`` is retried after this wait (the side's metric, its stall watch)."""
        ...

    def delivered(self, taken: Sequence[RecordSlice], events: EventBatch, took: int, ok: bool) -> None:
        """After each ``on_events``: the slices it took, the batch it was given, how many events it
        took, and whether it confirmed (metrics, lag)."""
        ...


def _resume_point(end: WalPosition, rest: EventBatch | None) -> WalPosition:
    """Where delivery resumes after a call: ``end``, or the first event of ``rest`` it did not take."""
    return end if rest is None or rest.first is None else rest.first.cursor()


class DeliveryFailed(Exception):
    """The consumer failed for good: it raised, reported itself dead, kept failing past its
    ``retry_timeout_s``, or refused an event with nowhere (or no way) to set it aside. The message
    is the one line the side logs or exits with; the cause is the consumer's error."""


class DeliveryLoop:
    """Ignite's delivery loop over one consumer, shared by the daemon and the realtime worker; the
    ``side`` says how to commit, wait and call (``Side``), ``policy`` how long to retry and where
    refused events go (``dead_letter``, from ``cdcd.dead_letters.writer``).

    ``deliver`` offers a batch until the consumer has taken all of it, committing after each
    confirmed call. A call that took nothing is offered again after ``retry_s`` (or not, when the
    side is stopping: the side that goes on later starts from the last commit).

    A ``RetriableError`` (from any consumer call): the same events are offered again, as a fresh
    batch (what the failed call iterated does not count as taken), with ``RETRY_BACKOFF``; each step
    is one ``consumer_retrying`` line. Still failing ``retry_timeout_s`` after the first failure:
    ``DeliveryFailed``.

    A ``RefusedEvent``: the events before the refused one are offered again (and committed once
    confirmed), ``dead_letter`` sets the refused one aside, the position moves past it, and the
    events after it follow. A ``dead_letter`` that runs again for the same event (a crash before
    that commit) must not set it aside twice. No ``dead_letter``: the events before it are delivered
    all the same, then ``DeliveryFailed`` naming the position.

    ``cache_change`` tells the consumer of created and destroyed caches under the same retry policy,
    so that a cache created or dropped during an outage waits it out as a batch does. Any other
    exception of the consumer: ``DeliveryFailed``."""

    def __init__(
        self,
        side: Side,
        consumer: Consumer,
        policy: DeliveryPolicy,
        *,
        retry_s: float,
        dead_letter: DeadLetter | None = None,
    ) -> None:
        self.side = side
        self.consumer = consumer
        self.policy = policy
        self.retry_s = retry_s
        self.dead_letter = dead_letter
        self.unconfirmed = False
        """A call returned False: nothing after the last commit may be committed until one returns True."""
        self.unconfirmed_end: WalPosition | None = None
        """Where the side commits once the consumer confirms what it took unconfirmed (``settle``)."""

    def deliver(self, item: Batch) -> bool:
        """Deliver ``item`` until the consumer has taken all of it; False if stopping cut it short."""
        events: EventBatch | None = item.events
        assert events is not None
        if len(events) == 0:
            self.passed(item.end)  # only the position moves (markers, CDC-off entries, segment ends)
            return True
        return self._deliver(events, item.end)

    def _deliver(self, events: EventBatch | None, end: WalPosition) -> bool:
        """``deliver`` of ``events``, of which everything before ``end`` is committed once all is taken."""
        side = self.side
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
            side.delivered(taken, events, took, ok)
            self.unconfirmed = not ok  # a False: the next confirmed call commits both
            self.passed(_resume_point(end, rest))
            if rest is not None and not took and side.wait(self.retry_s):
                return False
            events = rest
        return True

    def _set_aside(self, events: EventBatch, end: WalPosition, refused: RefusedEvent) -> tuple[bool, EventBatch | None]:
        """The events before the refused one delivered, it set aside: (False: stopping cut it short,
        the events after it)."""
        at = refused.position
        split = split_at(events, at)
        if split is None:
            first, last = events.first, events.last
            raise DeliveryFailed(
                f"consumer refused the event at {at.cursor()}, which is not in the batch it was given "
                f"({first and first.cursor()} to {last and last.cursor()}): {refused.reason}"
            ) from refused
        before, one, after = split
        event = next(iter(EventBatch(events.source_node, [one], events.cache_names)))
        error = describe(refused).removeprefix(f"{type(refused).__name__}: ")
        # Everything before it is delivered either way: a restart meets the refused event first.
        if before is not None and not self._deliver(before, at.cursor()):
            return False, None
        if self.dead_letter is None:
            raise DeliveryFailed(
                f"consumer refused the event at {at.cursor()} (cache {event.cache_name}): {error} "
                '(set [consumer] dead_letters = "on" to set such events aside)'
            ) from refused
        try:
            self.dead_letter(event, error)
        except Exception as exc:  # the dead-letter file: its message names it
            raise DeliveryFailed(str(exc)) from exc
        failpoints.hit("delivery.dead_letter.written")  # set aside, the position not yet past it
        log.warning("dead_letter", position=str(at.cursor()), cache=event.cache_name, error=error)
        self.passed(_resume_point(end, after))
        return True, after

    def passed(self, position: WalPosition) -> None:
        """Everything before ``position`` is delivered: committed now, or, while the consumer holds what it took
        unconfirmed, once it confirms (``settle``)."""
        if self.unconfirmed:
            self.unconfirmed_end = position
        else:
            self.side.commit(position)

    def confirm(self) -> bool:
        """Before a switch: empty calls until the consumer confirms what it took unconfirmed;
        False if stopping cut it short."""
        while self.unconfirmed:
            offered = self._offer_nothing()
            if offered is None:
                return False
            if offered:
                self.unconfirmed = False
                return True
            if self.side.wait(self.retry_s):
                return False
        return True

    def settle(self) -> bool:
        """The side has nothing more for the consumer for now: one call without events, and the position
        after what it took unconfirmed committed if it confirms. False: it did not (a consumer that confirms
        only with more events; the side asks again later) or stopping cut it short."""
        if not self.unconfirmed:
            return True
        if not self._offer_nothing():
            return False
        self.unconfirmed = False
        end, self.unconfirmed_end = self.unconfirmed_end, None
        if end is not None:
            self.side.commit(end)
        return True

    def _offer_nothing(self) -> bool | None:
        """``on_events`` without events: what it returned (None: stopping cut its retries short)."""
        try:
            offered = self._offer(EventBatch("", [], {}))
        except RefusedEvent as refused:
            raise DeliveryFailed(
                f"consumer refused the event at {refused.position.cursor()} in a call without events: {refused.reason}"
            ) from refused
        return None if offered is None else offered[0]

    def _offer(self, events: EventBatch) -> tuple[bool, EventBatch] | None:
        """(what ``on_events`` returned, the batch the successful call was given); None: stopping
        cut the retries of a ``RetriableError`` short."""
        given = events
        attempts = 0
        on_events = self.consumer.on_events

        def attempt() -> bool:
            nonlocal given, attempts
            if attempts:
                given = EventBatch(events.source_node, events.peek_slices(), events.cache_names)
            attempts += 1
            return on_events(given)

        try:
            ok = self._retried("on_events", attempt)
        except RetryInterrupted:
            return None
        return bool(ok), given

    def cache_change(self, change: CacheChange) -> bool:
        """Tell the consumer of ``change`` (``on_cache_change`` unless ``quiet``, then ``on_cache_drop``
        with the drops' places, else ``on_cache_destroy``); False: stopping cut its retries short (it
        did not succeed: the side must not move its position past it)."""
        consumer = self.consumer
        if (
            change.created
            and not change.quiet
            and not self._cache_call("on_cache_change", lambda: consumer.on_cache_change(change.created))
        ):
            return False
        if change.drops:
            return self._cache_call("on_cache_drop", lambda: consumer.on_cache_drop(change.drops))
        if change.destroyed:
            return self._cache_call("on_cache_destroy", lambda: consumer.on_cache_destroy(change.destroyed))
        return True

    def check_alive(self) -> None:
        """``DeliveryFailed`` unless the consumer says it is ``alive()``."""
        if not self._call("alive", self.consumer.alive):
            raise DeliveryFailed("consumer reports alive() == False")

    def _cache_call(self, what: str, call: Callable[[], object]) -> bool:
        failpoints.hit(f"delivery.{what}")  # a test stops the target here, before the first attempt
        try:
            self._retried(what, call)
        except RetryInterrupted:
            return False
        return True

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` through the side; a ``RetriableError`` (and an ``on_events`` ``RefusedEvent``) passes
        through to the loop, anything else fails the consumer."""
        try:
            return self.side.call(what, fn)
        except (RetriableError, DeliveryFailed):
            raise
        except Exception as exc:
            if what == "on_events" and isinstance(exc, RefusedEvent):
                raise
            raise DeliveryFailed(f"consumer {what}() raised {describe(exc)}") from exc

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        timeout_s = self.policy.retry_timeout_s

        def retrying(retry: Retry) -> None:
            log.warning(
                "consumer_retrying",
                call=what,
                error=describe(retry.error),
                attempt=retry.attempt,
                retry_in_s=round(retry.retry_in_s, 3),
                failing_for_s=round(retry.failing_for_s, 1),
                retry_timeout_s=timeout_s,
            )

        try:
            return retry_until(
                lambda: self._call(what, call),
                timeout_s,
                RETRY_BACKOFF,
                retriable=(RetriableError,),
                wait=lambda delay_s: self.side.wait(delay_s, True),
                on_retry=retrying,
            )
        except RetriesExhausted as exc:
            raise DeliveryFailed(
                f"consumer {what}() failing for {exc.failing_for_s:.1f} s over {exc.attempts} attempt(s) "
                f"(retry_timeout_s = {timeout_s:g}): {describe(exc.last)}"
            ) from exc.last
