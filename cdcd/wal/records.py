"""WAL record types (DESIGN §3).

Records, entries and versions are ``gc=False`` Structs: they hold only scalars, bytes, tuples and
each other, so they can never be part of a reference cycle, and a backlog of millions of them must
not make every garbage collection walk them. A DataRecord's entries are a tuple, not a list, for
the same reason: the collector stops tracking a tuple of untracked objects the first time it sees
it, where a list stays tracked and every older-generation pass would read each of its entries
again.

Every record is a tagged, frozen, array-like ``msgspec.Struct``; the tag is also the frame's
type byte. Schema rule: fields are only ever appended, with defaults, so older segments decode.

Keys and values travel as ``msgspec.Raw`` MessagePack: the node encodes them once (keys with a
deterministic map order, so equal keys have equal bytes) and the same bytes go to the WAL and to
LMDB. Readers decode only the record structure; a key or value becomes a Python object only when
a consumer asks for it. A reader for consumers that never look at entries one by one (the lake, which
ships the records' bytes to its row builder) goes further: a DataRecord's entries stay bytes, checked
but not decoded, until something reads them (``LazyEntries``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, ClassVar, overload

import msgspec

from cdcd.wal.pointer import WalPointer, WalPosition

NIL = msgspec.Raw(b"\xc0")
"""MessagePack ``nil``: the value of a DELETE entry."""

_any_decoder = msgspec.msgpack.Decoder()


class Op(enum.IntEnum):
    CREATE = 0
    UPDATE = 1
    DELETE = 2


class CacheOp(enum.IntEnum):
    CREATE = 0
    DESTROY = 1


class CacheVersion(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Entry version, ordered as Ignite's ``GridCacheVersion.compareTo``: topology version, then
    order, then node order. ``cluster_id`` and ``other_cluster_version`` take no part in the order
    (Ignite's data-center id does not either): versions of different clusters are told apart by the
    conflict resolver's rules, not by ``<``. The field order is the encoded one, fixed since the
    first segments (records are arrays): the comparison is written out below instead.

    A node's ``order`` restarts with its WAL; the topology version is what grows across a node's
    re-creation, restore from a backup or restart (``cdcd.node.topology``)."""

    order: int
    node_order: int
    cluster_id: int
    topology_version: int
    other_cluster_version: CacheVersion | None = None

    def __post_init__(self) -> None:
        # Ignite's GridCacheVersionEx holds a plain version: one level. A deeper chain can only be a
        # damaged record, and refusing it here (on decode, as a CorruptRecord naming the offset) keeps
        # every reader of versions from recursing over a chain as deep as the record is long.
        other = self.other_cluster_version
        if other is not None and other.other_cluster_version is not None:
            raise ValueError("other_cluster_version nests another cluster's version (at most one level)")

    def sort_key(self) -> tuple[int, int, int]:
        return (self.topology_version, self.order, self.node_order)

    def __lt__(self, other: CacheVersion) -> bool:
        return self.sort_key() < other.sort_key()

    def __le__(self, other: CacheVersion) -> bool:
        return self.sort_key() <= other.sort_key()

    def __gt__(self, other: CacheVersion) -> bool:
        return self.sort_key() > other.sort_key()

    def __ge__(self, other: CacheVersion) -> bool:
        return self.sort_key() >= other.sort_key()


class DataEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One changed key inside a DataRecord."""

    cache_id: int
    op: Op
    key: msgspec.Raw
    value: msgspec.Raw
    partition: int
    version: CacheVersion
    primary: bool = True
    expire_time_ms: int = 0

    def decoded_key(self) -> Any:
        return _any_decoder.decode(self.key)

    def decoded_value(self) -> Any:
        return _any_decoder.decode(self.value)


_entries_decoder = msgspec.msgpack.Decoder(tuple[DataEntry, ...])


class LazyEntries:
    """A DataRecord's entries as the WAL holds them (``raw``, already checked: cdcd/wal/frame.py), decoded into
    ``DataEntry`` objects the first time anything reads one and kept so. ``len`` needs no decoding. It reads as
    the tuple it stands for (index, slice, iteration, equality) and is encoded as those bytes
    (``encode_hook``); an encoder without that hook refuses it rather than write something else."""

    __slots__ = ("_decoded", "count", "raw")

    def __init__(self, raw: msgspec.Raw, count: int) -> None:
        self.raw = raw
        self.count = count
        self._decoded: tuple[DataEntry, ...] | None = None

    @property
    def decoded(self) -> bool:
        """Whether the entries were read (decoded) already."""
        return self._decoded is not None

    def entries(self) -> tuple[DataEntry, ...]:
        found = self._decoded
        if found is None:
            # Two threads of a daemon sharing the record may both decode it: the same tuple either way.
            found = self._decoded = _entries_decoder.decode(self.raw)
        return found

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> DataEntry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[DataEntry, ...]: ...
    def __getitem__(self, index: int | slice) -> DataEntry | tuple[DataEntry, ...]:
        return self.entries()[index]

    def __iter__(self) -> Iterator[DataEntry]:
        return iter(self.entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyEntries):
            return bytes(self.raw) == bytes(other.raw) or self.entries() == other.entries()
        return isinstance(other, tuple) and self.entries() == other

    def __hash__(self) -> int:
        return hash(self.entries())

    def __repr__(self) -> str:
        return repr(self.entries())


def encode_hook(obj: object) -> msgspec.Raw:
    """``enc_hook`` of every encoder that may meet a record read with ``LazyEntries``: its bytes as read."""
    if isinstance(obj, LazyEntries):
        return obj.raw
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


class CacheConfig(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Per-cache settings recorded with the cache."""

    partitions: int = 1024
    cdc_enabled: bool = True
    ttl_ms: int = 0
    """Default time to live of an entry put without ``ttl_ms`` (0: entries never expire)."""


class CacheInfo(msgspec.Struct, frozen=True, array_like=True):
    """A cache: id, name and settings (what CacheRecords carry, what consumers see)."""

    cache_id: int
    name: str
    config: CacheConfig = CacheConfig()


class _Record(msgspec.Struct, frozen=True, array_like=True, tag_field="t", gc=False):
    TYPE: ClassVar[int]


class DataRecord(_Record, frozen=True, tag=1):
    """A committed transaction: all its entries, atomic on recovery."""

    TYPE: ClassVar[int] = 1
    entries: tuple[DataEntry, ...]
    """A tuple, or where a reader left them undecoded a ``LazyEntries`` that reads as one."""
    commit_ts_ns: int
    resend: bool = False
    """Written by ``Node.resend``: existing entries sent again, not changes (Debezium's ``"r"``)."""


class CacheRecord(_Record, frozen=True, tag=2):
    """A cache created or destroyed."""

    TYPE: ClassVar[int] = 2
    cache_id: int
    name: str
    op: CacheOp
    config: CacheConfig = CacheConfig()
    ts_ns: int = 0
    version: CacheVersion | None = None
    """DESTROY: the version the node's next write gets. Every entry of the cache written before the
    drop has a lower version, so a replica rejects such an entry arriving late (None: a segment
    written before drops carried one)."""


class RealtimeCdcRecord(_Record, frozen=True, tag=3):
    """The node's realtime worker committed up to ``last`` (IEP-104)."""

    TYPE: ClassVar[int] = 3
    last: WalPosition


class StopRealtimeCdcRecord(_Record, frozen=True, tag=4):
    """Realtime capture stopped; the daemon delivers from ``last`` (None: from its own state)."""

    TYPE: ClassVar[int] = 4
    last: WalPosition | None = None
    reason: str = ""
    delivered: WalPointer | None = None
    """The last data record the node's consumer confirmed (None: none, or a node before this field): the
    daemon taking over asks its consumer whether the target still holds it (``Consumer.resume_at``)."""


class TryStartRealtimeCdcRecord(_Record, frozen=True, tag=5):
    """The node wants to capture again from this record on, once the daemon has passed it."""

    TYPE: ClassVar[int] = 5
    ts_ns: int = 0


class SegmentEnd(_Record, frozen=True, tag=6):
    """Last record of every archived segment; its absence marks a truncated segment."""

    TYPE: ClassVar[int] = 6


class Checkpoint(_Record, frozen=True, tag=7):
    """Every entry before this record is in the node's page store; recovery replays from here."""

    TYPE: ClassVar[int] = 7
    ts_ns: int = 0
    next_order: int = 0


Record = (
    DataRecord
    | CacheRecord
    | RealtimeCdcRecord
    | StopRealtimeCdcRecord
    | TryStartRealtimeCdcRecord
    | SegmentEnd
    | Checkpoint
)

RECORD_TYPES: dict[int, type[_Record]] = {
    cls.TYPE: cls
    for cls in (
        DataRecord,
        CacheRecord,
        RealtimeCdcRecord,
        StopRealtimeCdcRecord,
        TryStartRealtimeCdcRecord,
        SegmentEnd,
        Checkpoint,
    )
}
