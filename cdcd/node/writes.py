"""The node's one write path: every change (put, remove, transaction, replicated apply, expiry) goes
through ``WriteCore.write``, which looks up the newest write of each key, builds the DataEntries
with this node's versions, appends them as one DataRecord and puts them in the dirty map."""

from __future__ import annotations

import hashlib
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from cdcd import metrics
from cdcd.node.config import NodeConfig
from cdcd.node.store import _CACHE_PREFIX, PageStore, cache_prefix
from cdcd.node.wal_log import WalLog
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import NIL, CacheInfo, CacheVersion, DataEntry, DataRecord, Op


class _Remove:
    def __repr__(self) -> str:
        return "REMOVE"


REMOVE: Any = _Remove()
"""Marker value of a remove in a list of writes."""

_CREATE, _UPDATE, _DELETE = Op.CREATE, Op.UPDATE, Op.DELETE  # Op.X costs ~150 ns per access on 3.11
_time_ns = time.time_ns

# Keys are encoded with a deterministic map order so that equal keys have equal bytes.
key_encoder = msgspec.msgpack.Encoder(order="deterministic")
value_encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder()

MAX_NESTING = 256
"""Deepest key or value accepted. Readers decode records with Python's recursion limit (~1000
levels, less the reader's own stack): a value near that depth would be written fine and then be
undecodable for every consumer — a permanent poison pill in the WAL."""

MAX_KEY_BYTES = 64 * 1024
"""Longest key accepted, MessagePack-encoded. LMDB's own limit (511 bytes) is not the user's: the
page store keeps longer keys hashed, with the full key beside the value (``store.db_key``). This
bound keeps every key within what each sink carries in one message or frame."""

MAX_EXPIRE_TIME_MS = 2**63 - 1
"""Expire times are stored as unsigned 64-bit numbers; beyond this a peer's value is refused."""
MAX_TTL_MS = 100 * 365 * 86_400_000
"""A century: a longer TTL is a unit mistake (seconds or microseconds), not a wish."""


INT_RANGE = "integers from -2**63 to 2**64-1"
"""What MessagePack holds; msgspec's own OverflowError names neither the cache nor the key."""


class ValueRefused(ValueError):
    """A key or value the node will not write, raised by ``put``, ``put_all``, ``remove``,
    ``remove_all`` and transaction commits before anything is written: the whole call writes nothing.

    It cannot be encoded (an integer outside ``INT_RANGE``, a string with a lone surrogate, nesting
    past Python's recursion limit, a type MessagePack has no form for) or it breaks one of the node's
    limits (``MAX_NESTING``, ``MAX_KEY_BYTES``). ``cache``: the cache's name. ``key``: the key as the
    node's log lines name it, the hex ``key_hash`` of its MessagePack bytes (``key_masked``), or its
    repr with ``log_keys = true``; None when the key itself cannot be encoded and keys are masked,
    ``index`` then finds it. ``index``: the write's position among the call's writes (0 for ``put``).
    ``what``: ``"key"`` or ``"value"``. ``limit``: what the node accepts there."""

    def __init__(
        self,
        problem: str,
        *,
        cache: str,
        key: str | None,
        key_masked: bool,
        index: int,
        count: int,
        what: str,
        limit: str,
    ) -> None:
        if key is None:
            named = "key not shown, as keys are masked: log_keys = true shows it"
        else:
            named = f"key_hash {key}" if key_masked else f"key {key}"
        where = f"; write {index + 1} of {count}" if count > 1 else ""
        super().__init__(f"cache {cache!r}: {what} {problem} ({named}{where}; limit: {limit})")
        self.cache = cache
        self.key = key
        self.key_masked = key_masked
        self.index = index
        self.what = what
        self.limit = limit


class _TypeRefused(ValueRefused, TypeError):
    """A type MessagePack has no form for: a TypeError as msgspec's own was, and a ValueRefused."""


def key_hash(key_raw: bytes) -> str:
    """The name of a key in log lines and refusals: BLAKE2b-64 of its canonical MessagePack bytes (what the node
    stores), in hex. It tells lines about one key apart without showing the key; a key can be found by hashing
    candidates (``key_hash(key_encoder.encode(k))``). The replication resolver names keys by it too."""
    return hashlib.blake2b(key_raw, digest_size=8).hexdigest()


def _shown(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 200 else text[:197] + "..."


def too_deep(obj: Any) -> bool:
    """True if ``obj`` nests containers deeper than MAX_NESTING (iterative: no recursion here)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            children = item
        else:
            continue
        if depth > MAX_NESTING:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


_ENCODE_ERRORS = (OverflowError, UnicodeEncodeError, RecursionError, TypeError)


class Refuse:
    """The ValueRefused of one write: its cache, key, position among the call's writes and the node's masking."""

    __slots__ = ("count", "index", "info", "key", "log_keys")

    def __init__(self, info: CacheInfo, key: Any, index: int, count: int, log_keys: bool) -> None:
        self.info = info
        self.key = key
        self.index = index
        self.count = count
        self.log_keys = log_keys

    def __call__(
        self, what: str, problem: str, limit: str, key_raw: bytes | None, cls: type[ValueRefused] = ValueRefused
    ) -> ValueRefused:
        if self.log_keys:
            key: str | None = _shown(self.key)
        else:
            key = None if key_raw is None else key_hash(key_raw)
        return cls(
            problem,
            cache=self.info.name,
            key=key,
            key_masked=not self.log_keys,
            index=self.index,
            count=self.count,
            what=what,
            limit=limit,
        )

    def encoding(self, what: str, obj: Any, key_raw: bytes | None, exc: Exception) -> ValueRefused | None:
        """The refusal an encoder's error means, or None for an error that is not about ``obj``."""
        if isinstance(exc, OverflowError):
            return self(what, "holds an integer out of range", INT_RANGE, key_raw)
        if isinstance(exc, UnicodeEncodeError):
            bad = exc.object[exc.start : exc.end] if isinstance(exc.object, str) else ""
            return self(
                what,
                f"holds a string with a lone surrogate, {bad!r} at index {exc.start}",
                "strings that encode as UTF-8, without lone surrogates",
                key_raw,
            )
        if isinstance(exc, RecursionError) and too_deep(obj):
            return self.too_deep(what, key_raw)
        if isinstance(exc, TypeError) and "unsupported" in str(exc):
            limit = "the types msgspec encodes to MessagePack"
            return self(what, f"cannot be stored: {exc}", limit, key_raw, _TypeRefused)
        return None

    def too_deep(self, what: str, key_raw: bytes | None) -> ValueRefused:
        return self(what, f"nests deeper than {MAX_NESTING} levels", f"{MAX_NESTING} levels of nesting", key_raw)

    def _encode(self, encoder: msgspec.msgpack.Encoder, what: str, obj: Any, key_raw: bytes | None) -> bytes:
        """``encoder.encode(obj)``; an error msgspec raises for what the node refuses becomes ValueRefused."""
        try:
            return encoder.encode(obj)
        except _ENCODE_ERRORS as exc:
            refused = self.encoding(what, obj, key_raw, exc)
            if refused is None:
                raise
            raise refused from None

    def encode_key(self) -> bytes:
        """The key's canonical MessagePack bytes, or ValueRefused."""
        key = self.key
        raw = self._encode(key_encoder, "key", key, None)
        # Each level costs at least one byte, so only encodings this long can be too deep to read back.
        if len(raw) > MAX_NESTING:
            if len(raw) > MAX_KEY_BYTES:
                problem = f"is {len(raw)} bytes encoded, over the limit of {MAX_KEY_BYTES} bytes"
                raise self("key", problem, f"{MAX_KEY_BYTES} bytes", raw)
            if too_deep(key):
                raise self.too_deep("key", raw)
        return raw

    def encode_value(self, value: Any, key_raw: bytes) -> bytes:
        """The value's MessagePack bytes, or ValueRefused."""
        raw = self._encode(value_encoder, "value", value, key_raw)
        if len(raw) > MAX_NESTING and too_deep(value):
            raise self.too_deep("value", key_raw)
        return raw


def now_ms() -> int:
    """Wall-clock milliseconds: expire times are absolute (Ignite's), so they mean the same on a replica."""
    return time.time_ns() // 1_000_000


def expire_time(info: CacheInfo, ttl_ms: int | None, now: int) -> int:
    """The expire time of an entry put now (0: never): ``ttl_ms``, else the cache's default."""
    ttl = info.config.ttl_ms if ttl_ms is None else ttl_ms
    if not 0 <= ttl <= MAX_TTL_MS:
        raise ValueError(f"cache {info.name!r}: ttl_ms must be 0 (never) to {MAX_TTL_MS}, got {ttl}")
    return now + ttl if ttl else 0


class Current(NamedTuple):
    """The live state of a key: value bytes, version, expire time (0: never)."""

    value: bytes
    version: CacheVersion
    expire_time_ms: int


Change = tuple[CacheInfo, bytes, msgspec.Raw, int, "CacheVersion | None"]
"""One write asked for: (cache, key bytes, value (NIL: a remove), expire time in ms (0: never),
another cluster's version to keep in the entry's ``other_cluster_version`` or None). A plain tuple:
building a named one cost a third of a single put."""


Decide = Callable[[Change, Current | None], "tuple[Op, CacheVersion | None] | None"]
"""Given a change and the key's current state: the op to write and the origin version to keep, or
None to write nothing for it."""


class CacheDestroyed(ValueError):
    pass


class WriteCore:
    """The in-memory half of the node's state (dirty map, the snapshot a checkpoint is writing,
    the write order) behind one lock, and the one write path over it."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        store: PageStore,
        caches: dict[str, CacheInfo],
        dirty: dict[bytes, DataEntry],
        order: int,
        topology_version: int,
        stats: metrics.NodeStats,
        check_open: Callable[[], None],
    ) -> None:
        self.config = config
        self.topology_version = topology_version
        self.store = store
        self.caches = caches
        self.dirty = dirty
        self.snapshot: dict[bytes, DataEntry] | None = None  # being written by a checkpoint
        self.order = order
        self.stats = stats
        self.check_open = check_open
        self.accepting = True
        """False once the node is closing or failed (then ``check_open`` raises): the put fast path
        reads this flag instead of calling ``check_open``."""
        self.wal: WalLog | None = None
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # writers wait here while the dirty map is full
        self.checkpoint_wake = threading.Event()
        self.fsync_commits = config.wal_mode == "fsync"
        self._hard_limit = 2 * config.checkpoint_dirty_max_entries

    # --- lookups (the caller holds ``lock``) -----------------------------------------------------
    def pending_locked(self, full_key: bytes) -> DataEntry | None:
        """The newest write of a key not yet in the page store (dirty map, then the checkpoint's snapshot)."""
        e = self.dirty.get(full_key)
        if e is None and self.snapshot is not None:
            e = self.snapshot.get(full_key)
        return e

    def current_locked(self, full_key: bytes) -> Current | None:
        """The key's newest state, None if absent (an expired entry is still returned)."""
        e = self.pending_locked(full_key)
        if e is not None:
            return None if e.op is _DELETE else Current(bytes(e.value), e.version, e.expire_time_ms)
        stored = self.store.get_locked(full_key)  # a read txn per key was ~18% of a replicated apply
        return None if stored is None else Current(bytes(stored.value), stored.version, stored.expire_time_ms)

    def _room_locked(self) -> dict[bytes, DataEntry]:
        """The dirty map, once it has room: writers wait for a checkpoint beyond twice its bound."""
        self.check_open()
        while len(self.dirty) >= self._hard_limit:
            self.checkpoint_wake.set()
            self.room.wait()
            self.check_open()
        return self.dirty

    # --- reads -------------------------------------------------------------------------------------
    def get(self, info: CacheInfo, key: Any, default: Any) -> Any:
        full_key = cache_prefix(info.cache_id) + key_encoder.encode(key)
        with self.lock:
            e = self.pending_locked(full_key)
        if e is not None:
            if e.op is _DELETE or 0 < e.expire_time_ms <= now_ms():
                return default
            return decoder.decode(e.value)
        stored = self.store.get(full_key)
        if stored is None or 0 < stored.expire_time_ms <= now_ms():
            return default  # an expired entry is gone at once; the expirer writes its DELETE later
        return decoder.decode(stored.value)

    def live_entries(self, info: CacheInfo) -> dict[bytes, Current]:
        """Every live (not expired) entry of a cache by key bytes."""
        prefix = cache_prefix(info.cache_id)
        plen = len(prefix)
        with self.lock:
            overlay: dict[bytes, DataEntry] = {}
            if self.snapshot is not None:
                overlay.update((k[plen:], e) for k, e in self.snapshot.items() if k.startswith(prefix))
            overlay.update((k[plen:], e) for k, e in self.dirty.items() if k.startswith(prefix))
            stored = list(self.store.items(info.cache_id))
        now = now_ms()
        merged = {k: Current(bytes(v.value), v.version, v.expire_time_ms) for k, v in stored}
        for k, e in overlay.items():
            if e.op is _DELETE:
                merged.pop(k, None)
            else:
                merged[k] = Current(bytes(e.value), e.version, e.expire_time_ms)
        for k in [k for k, cur in merged.items() if 0 < cur.expire_time_ms <= now]:
            del merged[k]
        return merged

    # --- the write path ----------------------------------------------------------------------------
    def write(
        self,
        changes: Sequence[Change],
        decide: Decide | None = None,
        *,
        now: int = 0,
        wait_for_room: bool = True,
        skip_destroyed: bool = False,
    ) -> tuple[list[DataEntry], WalPointer | None]:
        """Write ``changes`` as one DataRecord; returns the entries written and the WAL end to wait for.

        Without ``decide`` a change is a local put or remove: a put of a live key (``now`` decides
        what has expired) is an UPDATE, else a CREATE; a remove of a key that is not live writes
        nothing. Each change sees the earlier changes of the same call. A change of a destroyed
        cache raises CacheDestroyed (or, ``skip_destroyed``, is dropped)."""
        if not changes:
            return [], None
        wal = self.wal
        assert wal is not None
        config = self.config
        node_order, cluster_id, topology_version = config.node_order, config.cluster_id, self.topology_version
        prefix = _CACHE_PREFIX.pack
        with self.lock:
            if wait_for_room:
                dirty = self._room_locked()
            else:  # the checkpointer's own thread: it is the one that makes room
                self.check_open()
                dirty = self.dirty
            caches = self.caches
            snapshot = self.snapshot
            live_stored = self.store.live_locked
            # Keys repeat within one call only in transactions and foreign senders' requests: a
            # change sees the call's earlier ones through ``seen`` (live or not) or ``latest``.
            seen: dict[bytes, bool] | None = {} if len(changes) > 1 else None
            repeats = decide is not None and len({(c[0].cache_id, c[1]) for c in changes}) != len(changes)
            latest: dict[bytes, Current | None] = {}  # only filled when keys repeat
            entries: list[DataEntry] = []
            keys: list[bytes] = []
            order = self.order
            creates = updates = deletes = 0
            for change in changes:
                info, key_raw, value, expire, origin = change
                if caches.get(info.name) is not info:
                    if skip_destroyed:
                        continue
                    raise CacheDestroyed(f"cache {info.name!r} was destroyed")
                full_key = prefix(info.cache_id) + key_raw
                if decide is None:
                    if seen is not None and full_key in seen:
                        exists = seen[full_key]
                    else:
                        e = dirty.get(full_key)
                        if e is None and snapshot is not None:
                            e = snapshot.get(full_key)
                        if e is not None:  # an expired entry counts as gone
                            exists = e.op is not _DELETE and not 0 < e.expire_time_ms <= now
                        else:
                            exists = live_stored(full_key, now)
                    if value is NIL:
                        if not exists:
                            continue
                        op = _DELETE
                        deletes += 1
                    elif exists:
                        op = _UPDATE
                        updates += 1
                    else:
                        op = _CREATE
                        creates += 1
                    if seen is not None:
                        seen[full_key] = op is not _DELETE
                else:
                    cur = latest[full_key] if repeats and full_key in latest else self.current_locked(full_key)
                    verdict = decide(change, cur)
                    if verdict is None:
                        continue
                    op, origin = verdict
                    if op is _DELETE:
                        value = NIL
                        deletes += 1
                    elif op is _UPDATE:
                        updates += 1
                    else:
                        creates += 1
                order += 1
                version = CacheVersion(order, node_order, cluster_id, topology_version, origin)
                entries.append(
                    DataEntry(
                        info.cache_id,
                        op,
                        msgspec.Raw(key_raw),
                        value,
                        zlib.crc32(key_raw) % info.config.partitions,
                        version,
                        True,
                        expire,
                    )
                )
                keys.append(full_key)
                if repeats:
                    latest[full_key] = None if op is _DELETE else Current(bytes(value), version, expire)
            if not entries:
                return entries, None
            end = wal.append_end(DataRecord(tuple(entries), time.time_ns()), True)
            self.order = order
            if len(keys) == 1:
                dirty[keys[0]] = entries[0]
            else:
                dirty.update(zip(keys, entries, strict=True))
            stats = self.stats
            stats.transactions += 1
            counts = stats.entries
            if creates:
                counts[_CREATE] += creates
            if updates:
                counts[_UPDATE] += updates
            if deletes:
                counts[_DELETE] += deletes
            if len(dirty) >= config.checkpoint_dirty_max_entries:
                self.checkpoint_wake.set()
        return entries, end

    def commit(self, writes: Sequence[tuple[CacheInfo, Any, Any, int | None]]) -> int:
        """Local puts and removes (``value`` REMOVE) as one DataRecord, durable per ``wal_mode``;
        returns the number of entries written. ``ttl_ms`` None: the cache's."""
        now = now_ms()
        # Encoding needs no lock: prepare before taking it.
        changes: list[Change] = []
        count = len(writes)
        log_keys = self.config.log_keys
        for index, (info, key, value, ttl_ms) in enumerate(writes):
            if value is None:
                raise ValueError(f"cache {info.name!r}: value must not be None (use remove)")
            refuse = Refuse(info, key, index, count, log_keys)
            key_raw = refuse.encode_key()
            if value is REMOVE:
                changes.append((info, key_raw, NIL, 0, None))
            else:
                raw = msgspec.Raw(refuse.encode_value(value, key_raw))
                changes.append((info, key_raw, raw, expire_time(info, ttl_ms, now), None))
        entries, end = self.write(changes, now=now)
        if end is not None and self.fsync_commits:
            self.wait_durable(end)
        return len(entries)

    def put(self, info: CacheInfo, key: Any, value: Any, ttl_ms: int | None) -> None:
        """``Cache.put``: exactly ``commit([(info, key, value, ttl_ms)])``, without the generic
        path's lists, tuples and per-change branches (a single put is the most common call)."""
        if value is None or value is REMOVE:
            self.commit([(info, key, value, ttl_ms)])
            return
        try:
            key_raw = key_encoder.encode(key)
            raw = value_encoder.encode(value)
        except _ENCODE_ERRORS:
            # The slow path names what was refused (or raises the error that is not about the input).
            refuse = Refuse(info, key, 0, 1, self.config.log_keys)
            refuse.encode_value(value, refuse.encode_key())
            raise
        # Each level costs at least one byte, so only encodings this long can be too deep to read back.
        if len(key_raw) > MAX_NESTING and (len(key_raw) > MAX_KEY_BYTES or too_deep(key)):
            Refuse(info, key, 0, 1, self.config.log_keys).encode_key()  # raises, naming the limit
        if len(raw) > MAX_NESTING and too_deep(value):
            raise Refuse(info, key, 0, 1, self.config.log_keys).too_deep("value", key_raw)
        cache_config = info.config
        ttl = cache_config.ttl_ms if ttl_ms is None else ttl_ms
        if ttl and not 0 < ttl <= MAX_TTL_MS:
            expire_time(info, ttl, 0)  # raises the one error message for a bad TTL
        full_key = _CACHE_PREFIX.pack(info.cache_id) + key_raw
        partition = zlib.crc32(key_raw) % cache_config.partitions
        wal = self.wal
        assert wal is not None
        config = self.config
        with self.lock:
            if not self.accepting:
                self.check_open()
            dirty = self.dirty
            if len(dirty) >= self._hard_limit:
                dirty = self._room_locked()
            if self.caches.get(info.name) is not info:
                raise CacheDestroyed(f"cache {info.name!r} was destroyed")
            # One clock read: the commit timestamp and "now" for expiry (the generic path reads two).
            ts_ns = _time_ns()
            now = ts_ns // 1_000_000
            e = dirty.get(full_key)
            if e is None and self.snapshot is not None:
                e = self.snapshot.get(full_key)
            if e is not None:  # an expired entry counts as gone
                op = _CREATE if e.op is _DELETE or 0 < e.expire_time_ms <= now else _UPDATE
            else:
                op = _UPDATE if self.store.live_locked(full_key, now) else _CREATE
            order = self.order + 1
            entry = DataEntry(
                info.cache_id,
                op,
                msgspec.Raw(key_raw),
                msgspec.Raw(raw),
                partition,
                CacheVersion(order, config.node_order, config.cluster_id, self.topology_version, None),
                True,
                now + ttl if ttl else 0,
            )
            end = wal.append_end(DataRecord((entry,), ts_ns), self.fsync_commits)
            self.order = order
            dirty[full_key] = entry
            stats = self.stats
            stats.transactions += 1
            stats.entries[op] += 1
            if len(dirty) >= config.checkpoint_dirty_max_entries:
                self.checkpoint_wake.set()
        if end is not None:
            wal.wait_durable(end)

    def resend(self, info: CacheInfo, keys: Sequence[bytes]) -> tuple[int, WalPointer | None]:
        """``Node.resend``: the current entries of ``keys`` as CREATEs with their own versions, in
        records of about a quarter segment (at most 1 MiB); the dirty map is untouched (nothing
        changes). Each record's values are read under the lock it is appended under."""
        wal = self.wal
        assert wal is not None
        prefix = cache_prefix(info.cache_id)
        record_bytes = min(1 << 20, self.config.wal_segment_size_bytes // 4)
        end = None
        sent = i = 0
        while i < len(keys):
            with self.lock:
                self.check_open()
                entries: list[DataEntry] = []
                size = 0
                while i < len(keys) and size < record_bytes:
                    k = keys[i]
                    i += 1
                    current = self.current_locked(prefix + k)
                    if current is None:  # removed since the key list was taken: its DELETE is in the WAL
                        continue
                    value, version, expire = current
                    if 0 < expire <= now_ms():  # expired meanwhile: its DELETE comes from the expirer
                        continue
                    partition = zlib.crc32(k) % info.config.partitions
                    entries.append(
                        DataEntry(
                            info.cache_id, _CREATE, msgspec.Raw(k), msgspec.Raw(value), partition, version, True, expire
                        )
                    )
                    size += len(k) + len(value) + 32
                if entries:
                    _ptr, end = wal.append(DataRecord(tuple(entries), time.time_ns(), resend=True))
                    sent += len(entries)
        return sent, end

    def wait_durable(self, end: WalPointer) -> None:
        assert self.wal is not None
        self.wal.wait_durable(end)
