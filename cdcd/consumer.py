"""The consumer protocol (DESIGN §7): what the daemon and the node's realtime worker call.

Modelled on Ignite's ``CdcConsumer``: ``on_events`` returns True when the consumer has made the
batch durable (the caller then commits the position), False for "not committed yet, keep going"
(a later True commits everything before it). An exception is fatal.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import CacheInfo, CacheVersion, DataEntry, DataRecord, Op

__all__ = ["CacheInfo", "CdcEvent", "Consumer", "EventBatch", "RecordSlice"]

_decoder = msgspec.msgpack.Decoder()

OP_NAMES = {Op.CREATE: "create", Op.UPDATE: "update", Op.DELETE: "delete"}


class CdcEvent:
    """One change. Key and value are decoded from MessagePack on first access."""

    __slots__ = ("_entry", "cache_name", "commit_ts_ns", "position")

    def __init__(self, entry: DataEntry, cache_name: str, commit_ts_ns: int, position: WalPosition) -> None:
        self._entry = entry
        self.cache_name = cache_name
        self.commit_ts_ns = commit_ts_ns
        self.position = position

    @property
    def entry(self) -> DataEntry:
        return self._entry

    @property
    def key(self) -> Any:
        return _decoder.decode(self._entry.key)

    @property
    def value(self) -> Any:
        """The new value; None for a DELETE."""
        return _decoder.decode(self._entry.value)

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


class RecordSlice(msgspec.Struct, frozen=True):
    """Entries ``start..`` of one DataRecord at ``pointer`` (earlier ones were already delivered)."""

    pointer: WalPointer
    record: DataRecord
    start: int = 0


class EventBatch:
    """Consecutive changes of one source node, in WAL order, with their position range.

    Built from whole records (events are created only when iterated), so a consumer that only
    counts pays nothing per event.
    """

    __slots__ = ("_count", "_names", "slices", "source_node")

    def __init__(self, source_node: str, slices: Sequence[RecordSlice], cache_names: dict[int, str]) -> None:
        self.source_node = source_node
        self.slices = slices
        self._names = cache_names
        self._count = sum(len(s.record.entries) - s.start for s in slices)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[CdcEvent]:
        names = self._names
        for s in self.slices:
            ptr = s.pointer
            ts = s.record.commit_ts_ns
            entries = s.record.entries
            for i in range(s.start, len(entries)):
                e = entries[i]
                name = names.get(e.cache_id) or f"cache-{e.cache_id}"
                yield CdcEvent(e, name, ts, WalPosition(ptr.segment, ptr.offset, i))

    @property
    def first(self) -> WalPosition | None:
        """Position of the first event."""
        if not self.slices:
            return None
        s = self.slices[0]
        return WalPosition(s.pointer.segment, s.pointer.offset, s.start)

    @property
    def last(self) -> WalPosition | None:
        """Position of the last event."""
        if not self.slices:
            return None
        s = self.slices[-1]
        return WalPosition(s.pointer.segment, s.pointer.offset, len(s.record.entries) - 1)

    @property
    def last_commit_ts_ns(self) -> int:
        return self.slices[-1].record.commit_ts_ns if self.slices else 0

    def cache_name(self, cache_id: int) -> str:
        return self._names.get(cache_id) or f"cache-{cache_id}"


class Consumer:
    """Base class of consumers; override what you need. ``start``/``stop`` run once each."""

    def start(self, registry: CollectorRegistry) -> None:
        """Called once before any event; ``registry`` is where the consumer may add metrics."""

    def on_events(self, batch: EventBatch) -> bool:
        """Handle a batch; True once it is durable on the consumer's side."""
        raise NotImplementedError

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        """Caches created (or first seen), before any event of theirs."""

    def on_cache_destroy(self, cache_ids: Sequence[int]) -> None:
        """Caches destroyed."""

    def stop(self) -> None:
        """Release resources; called once, also after a failure."""

    def interrupt(self) -> None:
        """The caller is stopping: a consumer blocked inside ``on_events`` (waiting out a failing
        target) should return False soon. Called from a signal handler or another thread."""

    def alive(self) -> bool:
        """False makes the caller fail fast (the service manager restarts it)."""
        return True
