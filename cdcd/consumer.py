"""The consumer protocol (DESIGN §7): what the daemon and the node's realtime worker call.

Modelled on Ignite's ``CdcConsumer``: ``on_events`` returns True when the consumer has made what
it took of the batch durable (the caller then commits the position after it), False for "not
committed yet, keep going" (a later True commits everything before it). Events the consumer did
not pull come again in the next call (``EventBatch.split_taken``). A ``RetriableError`` is a
transient failure: the caller offers the same events again with backoff for up to
``retry_timeout_s`` (``[consumer] retry_timeout_s``). A ``RefusedEvent`` names one event the target
will never take: with ``[consumer] dead_letters = "on"`` the caller sets it aside and goes on,
otherwise it fails naming its position. Any other exception is fatal.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, count, repeat
from typing import Any, NamedTuple

import msgspec
from prometheus_client import CollectorRegistry

from cdcd.config import ConfigError
from cdcd.wal.pointer import EventAddress, WalPointer, WalPosition
from cdcd.wal.records import CacheInfo, CacheVersion, DataEntry, DataRecord, Op

__all__ = [
    "DEFAULT_RETRY_TIMEOUT_S",
    "CacheDrop",
    "CacheInfo",
    "CdcEvent",
    "Consumer",
    "DeliveryPolicy",
    "EventBatch",
    "EventSource",
    "RecordSlice",
    "RefusedEvent",
    "ResumeAt",
    "RetriableError",
    "LoadedConsumer",
    "as_consumer",
    "enabled_slices",
]

DEFAULT_RETRY_TIMEOUT_S = 300.0


class RetriableError(Exception):
    """Raised by ``on_events`` for a failure that waiting may cure (a store or broker unreachable, a
    full disk): nothing of the batch counts as taken, the caller offers the same events again with
    exponential backoff and exits (code 4) only once it has failed for ``retry_timeout_s``. Raise
    it ``from`` the underlying error: the log line shows both. The consumer must be able to take
    the same events again (what an earlier attempt landed must not land twice)."""


class RefusedEvent(Exception):
    """Raised by ``on_events``: the target refuses the event at ``position`` for good (too large for
    it, a value it cannot hold, a user rule); ``str()`` says why. As with ``RetriableError`` nothing
    of the batch counts as taken. The caller then offers the events before it again, sets it aside
    as a dead letter (``[consumer] dead_letters``; off: it fails, naming the position) and goes on
    with the events after it, so the consumer must take the same events again as well."""

    def __init__(self, position: EventAddress, reason: str) -> None:
        super().__init__(reason)
        self.position = position
        self.reason = reason


_decode = msgspec.msgpack.Decoder().decode

OP_NAMES = {Op.CREATE: "create", Op.UPDATE: "update", Op.DELETE: "delete"}


class EventSource(msgspec.Struct, frozen=True, gc=False):
    """What the events of one record slice share: where the record is, its commit time and the
    batch's cache names (looked up when an event's ``cache_name`` is read)."""

    pointer: WalPointer
    commit_ts_ns: int
    names: dict[int, str]
    resend: bool = False


class CdcEvent(msgspec.Struct, frozen=True, gc=False, eq=False):
    """One change. Key and value are decoded from MessagePack on each access (read them once).

    A Struct built in C from the entry, its record's ``EventSource`` and its index: iterating a
    batch creates one small object per event and decodes nothing; cache name and position are
    derived when read.
    """

    _entry: DataEntry
    _source: EventSource
    _index: int

    @property
    def entry(self) -> DataEntry:
        return self._entry

    @property
    def cache_name(self) -> str:
        cache_id = self._entry.cache_id
        return self._source.names.get(cache_id) or f"cache-{cache_id}"

    @property
    def commit_ts_ns(self) -> int:
        return self._source.commit_ts_ns

    @property
    def position(self) -> EventAddress:
        ptr = self._source.pointer
        return EventAddress(ptr.segment, ptr.offset, self._index)

    @property
    def key(self) -> Any:
        return _decode(self._entry.key)

    @property
    def resend(self) -> bool:
        """An existing entry sent again by ``Node.resend`` (a snapshot read), not a change."""
        return self._source.resend

    @property
    def value(self) -> Any:
        """The new value; None for a DELETE."""
        return _decode(self._entry.value)

    @property
    def key_bytes(self) -> bytes:
        """The key as MessagePack (deterministic map order: equal keys, equal bytes)."""
        return bytes(self._entry.key)

    @property
    def value_bytes(self) -> bytes:
        return bytes(self._entry.value)

    @property
    def op(self) -> Op:
        return self._entry.op

    @property
    def op_name(self) -> str:
        return OP_NAMES[self._entry.op]

    @property
    def cache_id(self) -> int:
        return self._entry.cache_id

    @property
    def partition(self) -> int:
        return self._entry.partition

    @property
    def version(self) -> CacheVersion:
        return self._entry.version

    @property
    def primary(self) -> bool:
        return self._entry.primary

    @property
    def expire_time_ms(self) -> int:
        return self._entry.expire_time_ms

    def __repr__(self) -> str:
        return f"CdcEvent({self.cache_name}, {self.op_name}, {self.key!r}, pos={self.position})"


class CacheDrop(msgspec.Struct, frozen=True):
    """A cache destroyed on the source node (its WAL ``CacheRecord`` DESTROY): everything of the cache
    before ``position`` is gone; a cache of the same name may be created again after it."""

    cache_id: int
    name: str
    position: WalPointer
    """The DESTROY record: a sink that lands the drop exactly once keys it by this."""
    ts_ns: int
    version: CacheVersion | None
    """Entries of the cache written before the drop have lower versions (None: an old segment)."""
    source_node: str


class RecordSlice(msgspec.Struct, frozen=True, gc=False):
    """Entries ``start..stop`` of one DataRecord at ``pointer`` (earlier ones were already delivered;
    ``stop`` None: to the record's end). A record that mixes caches with ``cdc_enabled = false``
    into its transaction comes as several slices, one per run of entries of the others."""

    pointer: WalPointer
    record: DataRecord
    start: int = 0
    stop: int | None = None
    payload: bytes | None = None
    """The record's MessagePack as the WAL holds it, when the reader kept it (``SegmentReader.frames``):
    what a sink that ships records on sends as is instead of encoding ``record`` again (the lake's
    ``arrow.pack``). None (slices built from records in memory, the realtime worker's): encode ``record``.
    Its keys and values point into these bytes already, so a slice holding them costs no copy."""

    @property
    def end(self) -> int:
        """Index after the slice's last entry."""
        return len(self.record.entries) if self.stop is None else self.stop


_cache_id = operator.attrgetter("cache_id")


def enabled_slices(
    ptr: WalPointer, record: DataRecord, start: int, disabled: AbstractSet[int], payload: bytes | None = None
) -> list[RecordSlice]:
    """The entries ``start..`` of ``record`` outside the caches in ``disabled``, as slices (none if
    every one is of such a cache). Entries keep their index: positions stay those of the WAL."""
    entries = record.entries
    if not disabled or disabled.isdisjoint(map(_cache_id, entries)):
        return [RecordSlice(ptr, record, start, None, payload)]
    out = []
    run = -1
    for i in range(start, len(entries)):
        if entries[i].cache_id in disabled:
            if run >= 0:
                out.append(RecordSlice(ptr, record, run, i, payload))
                run = -1
        elif run < 0:
            run = i
    if run >= 0:
        out.append(RecordSlice(ptr, record, run, None, payload))
    return out


class EventBatch:
    """Consecutive changes of one source node, in WAL order, with their position range.

    Built from whole records (events are created only when iterated), so a consumer that only
    counts pays nothing per event.

    What a consumer took (Ignite's iterator state): everything if it read ``slices`` (a sink that
    takes the batch whole), iterated to the end, or never iterated at all; otherwise the events up
    to the last one an iteration pulled (the furthest any iteration got). ``split_taken`` tells the
    caller, which hands the rest to the next ``on_events``.
    """

    __slots__ = ("_at", "_at_slice", "_best", "_count", "_iterated", "_names", "_slices", "_whole", "source_node")

    def __init__(self, source_node: str, slices: Sequence[RecordSlice], cache_names: dict[int, str]) -> None:
        self.source_node = source_node
        self._slices = slices
        self._names = cache_names
        self._count = sum((len(s.record.entries) if s.stop is None else s.stop) - s.start for s in slices)
        self._whole = False
        self._iterated = False
        self._at_slice = -1
        self._at: tuple[Iterator[DataEntry], int] | None = None
        """The entry iterator of slice ``_at_slice`` and that slice's end: how far it got."""
        self._best = (-1, -1)

    @property
    def slices(self) -> Sequence[RecordSlice]:
        """The batch as record slices; reading them takes the whole batch."""
        self._whole = True
        return self._slices

    def peek_slices(self) -> Sequence[RecordSlice]:
        """The record slices for the caller of ``on_events`` (metrics, lag): reading them here
        does not count as the consumer taking the batch."""
        return self._slices

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[CdcEvent]:
        if self._at_slice >= 0:  # an earlier iteration: keep how far it got
            self._best = max(self._best, self._pulled())
            self._at_slice, self._at = -1, None
        self._iterated = True
        # Events are made in C (map over the entries); Python runs once per slice, not per event.
        return chain.from_iterable(self._slice_events())

    def _slice_events(self) -> Iterator[Iterator[CdcEvent]]:
        names = self._names
        for k, s in enumerate(self._slices):
            entries = s.record.entries
            stop = len(entries) if s.stop is None else s.stop
            it = iter(entries if s.start == 0 and stop == len(entries) else entries[s.start : stop])
            self._at_slice, self._at = k, (it, stop)
            source = EventSource(s.pointer, s.record.commit_ts_ns, names, s.record.resend)
            yield map(CdcEvent, it, repeat(source), count(s.start))
        self._whole = True

    def _pulled(self) -> tuple[int, int]:
        """(slice, entry index) of the last event the current iteration pulled."""
        if self._at is None:
            return (-1, -1)
        it, stop = self._at
        # A list iterator knows how many items it has left: the events not yet pulled.
        return (self._at_slice, stop - operator.length_hint(it) - 1)

    def split_taken(self) -> tuple[Sequence[RecordSlice], EventBatch | None]:
        """After ``on_events``: the slices the consumer took, and a batch of the rest (None: it took
        them all; the rest is never empty)."""
        slices = self._slices
        if self._whole or not self._iterated:
            return slices, None
        k, i = max(self._best, self._pulled())
        if k < 0:
            return [], EventBatch(self.source_node, slices, self._names)
        s = slices[k]
        taken = [*slices[:k], RecordSlice(s.pointer, s.record, s.start, i + 1, s.payload)]
        rest = list(slices[k + 1 :])
        if i + 1 < s.end:
            rest.insert(0, RecordSlice(s.pointer, s.record, i + 1, s.stop, s.payload))
        if not rest:
            return slices, None
        return taken, EventBatch(self.source_node, rest, self._names)

    @property
    def first(self) -> EventAddress | None:
        """Address of the first event."""
        if not self._slices:
            return None
        s = self._slices[0]
        return EventAddress(s.pointer.segment, s.pointer.offset, s.start)

    @property
    def last(self) -> EventAddress | None:
        """Address of the last event."""
        if not self._slices:
            return None
        s = self._slices[-1]
        return EventAddress(s.pointer.segment, s.pointer.offset, s.end - 1)

    @property
    def last_commit_ts_ns(self) -> int:
        return self._slices[-1].record.commit_ts_ns if self._slices else 0

    def cache_name(self, cache_id: int) -> str:
        return self._names.get(cache_id) or f"cache-{cache_id}"

    @property
    def cache_names(self) -> dict[int, str]:
        """Cache id -> name, what ``cache_name`` looks up (read it, never change it)."""
        return self._names


class ResumeAt(msgspec.Struct, frozen=True):
    """A consumer's answer to ``Consumer.resume_at``: its target lost part of what was delivered."""

    position: WalPosition
    """Where delivery must start again (a record's start: the consumer drops what it holds already)."""
    holds: str
    """What the target holds, for the caller's log or error line (e.g. the lake, its version, its mark)."""


class Consumer:
    """Base class of consumers; override what you need. ``start``/``stop`` run once each."""

    min_batch_interval_ms: int = 0
    """The shortest interval between the starts of two of the node's realtime deliveries this consumer asks for
    (fewer, larger calls: what arrives meanwhile joins the next); the node's ``realtime_batch_min_interval_ms``
    wins when longer. The daemon's deliveries are not paced by it."""
    decodes_entries: bool = True
    """False on a kind that never reads a batch's events or its records' entries one by one (the lake ships
    ``RecordSlice.payload`` to its row builder; null only counts): the daemon then leaves DataRecords' entries
    undecoded (``cdcd.wal.records.LazyEntries``) unless another of its consumers reads them. Only speed depends
    on it: entries decode the first time anything reads them."""
    dead_letters: bool = False
    """Set on a kind that keeps refused events itself (Kafka's ``<topic>.dlq``) when ``[consumer]
    dead_letters = "on"``; the caller's own policy is ``DeliveryPolicy``, never read from here."""

    def start(self, registry: CollectorRegistry) -> None:
        """Called once before any event; ``registry`` is where the consumer may add metrics."""

    def on_events(self, batch: EventBatch) -> bool:
        """Handle a batch; True once it is durable on the consumer's side."""
        raise NotImplementedError

    def resume_at(self, source_node: str, delivered: WalPointer) -> ResumeAt | None:
        """Called after ``start()`` by a caller that knows ``delivered``, the last data record of
        ``source_node`` it delivered and committed. A consumer whose target can say how far it holds
        (the lake's mark) returns where delivery must start again when that is before ``delivered``
        (the target restored from a backup, its newest commit deleted): the caller moves back there,
        or stops with one line when those records are gone. None: the target holds everything, or
        cannot tell (the default)."""
        return None

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        """Caches created (or first seen), before any event of theirs."""

    def on_cache_destroy(self, cache_ids: Sequence[int]) -> None:
        """Caches destroyed."""

    def on_cache_drop(self, drops: Sequence[CacheDrop]) -> None:
        """Caches destroyed, with where and when (after every event before the drops was delivered
        and confirmed; the caller commits its position past them once this returns). The default
        calls ``on_cache_destroy``; a sink that carries drops to its target overrides this."""
        self.on_cache_destroy([d.cache_id for d in drops])

    def stop(self) -> None:
        """Release resources; called once, also after a failure."""

    def interrupt(self) -> None:
        """The caller is stopping: a consumer blocked inside ``on_events`` (waiting out a failing
        target) should return False soon. Called from a signal handler or another thread."""

    def alive(self) -> bool:
        """False makes the caller fail fast (the service manager restarts it)."""
        return True


class DeliveryPolicy(msgspec.Struct, frozen=True):
    """How the caller delivers to one consumer, read once from its table (``[consumer]`` or
    ``[consumers.<name>]``), never from the consumer object."""

    retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_S
    """How long a ``RetriableError`` is retried before the consumer fails."""
    dead_letters_path: str = ""
    """The jsonl file the caller sets a ``RefusedEvent``'s event aside in; "" with dead letters off
    (refused: the consumer fails) or kept by the consumer itself (``Consumer.dead_letters``)."""

    @classmethod
    def from_table(cls, table: Mapping[str, Any], source: str) -> DeliveryPolicy:
        """The policy of a consumer table; errors name ``source`` and the key (the kind's own rules on
        dead letters are ``cdcd.sinks``')."""
        retry = table.get("retry_timeout_s", DEFAULT_RETRY_TIMEOUT_S)
        if isinstance(retry, bool) or not isinstance(retry, int | float) or not math.isfinite(retry) or retry < 0:
            raise ConfigError(f"{source}: key 'retry_timeout_s': {retry!r}: must be a finite number of seconds >= 0")
        value = table.get("dead_letters", "off")
        if value not in ("off", "on"):
            raise ConfigError(f'{source}: key \'dead_letters\': {value!r}: must be "off" or "on"')
        path = table.get("dead_letters_path", "")
        if not isinstance(path, str):
            raise ConfigError(f"{source}: key 'dead_letters_path': {path!r}: must be a file path")
        if value == "off" and path:
            raise ConfigError(f"{source}: key 'dead_letters_path': set, but dead_letters is \"off\"")
        return cls(float(retry), path)


class LoadedConsumer(NamedTuple):
    """A consumer as ``cdcd.sinks.load_consumer`` builds it, with the policy its table gives it."""

    consumer: Consumer
    policy: DeliveryPolicy


_HOOKS = (
    *("start", "on_events", "resume_at", "on_cache_change", "on_cache_destroy", "on_cache_drop"),
    *("stop", "interrupt", "alive"),
)


class UserConsumer(Consumer):
    """A user class that does not subclass ``Consumer``, wrapped once where it is built: what it lacks
    is ``Consumer``'s default, so no caller probes it for a method."""

    def __init__(self, user: object) -> None:
        self.user = user
        for name in _HOOKS:
            method = getattr(user, name, None)
            if callable(method):
                setattr(self, name, method)  # an instance attribute hides the default method


def as_consumer(obj: object) -> Consumer:
    """``obj`` itself if it is a ``Consumer``, else wrapped as one (``UserConsumer``)."""
    return obj if isinstance(obj, Consumer) else UserConsumer(obj)
