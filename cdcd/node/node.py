"""The storage node: caches over LMDB, every change written ahead to a segmented WAL."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import structlog

from cdcd import metrics
from cdcd.config import ConfigError, convert, load_toml, split_host_port
from cdcd.control import ControlError, ControlServer
from cdcd.lock import DirLock, LockHeld
from cdcd.node.archiver import Archiver, check_same_filesystem
from cdcd.node.cache import REMOVE, Cache
from cdcd.node.config import NodeConfig
from cdcd.node.diff import digests
from cdcd.node.identity import write_node_id
from cdcd.node.realtime import (
    Metastorage,
    RealtimeError,
    RealtimeMode,
    RealtimeWorker,
    daemon_position,
    read_daemon_state,
)
from cdcd.node.recovery import recover
from cdcd.node.store import CheckpointMeta, PageStore, cache_prefix
from cdcd.node.transaction import Transaction
from cdcd.node.wal_log import WalLog
from cdcd.replication import credentials
from cdcd.replication.protocol import Applied, Apply, ReplEntry, Welcome
from cdcd.replication.resolver import ConflictResolver, Held, Rule, load_resolver, origin_version
from cdcd.replication.server import ReplicationServer, RequestRefused
from cdcd.secrets import mask_mapping
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import (
    NIL,
    CacheConfig,
    CacheInfo,
    CacheOp,
    CacheRecord,
    CacheVersion,
    Checkpoint,
    DataEntry,
    DataRecord,
    Op,
)

log = structlog.get_logger("cdcd.node")

# Keys are encoded with a deterministic map order so that equal keys have equal bytes.
_key_encoder = msgspec.msgpack.Encoder(order="deterministic")
_value_encoder = msgspec.msgpack.Encoder()

MAX_NESTING = 256
"""Deepest key or value accepted. Readers decode records with Python's recursion limit (~1000
levels, less the reader's own stack): a value near that depth would be written fine and then be
undecodable for every consumer — a permanent poison pill in the WAL."""


def _too_deep(obj: Any) -> bool:
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


def _encode(encoder: msgspec.msgpack.Encoder, obj: Any, info: CacheInfo, what: str) -> bytes:
    raw = encoder.encode(obj)
    # Each level costs at least one byte, so only encodings this long can be too deep to read back.
    if len(raw) > MAX_NESTING and _too_deep(obj):
        raise ValueError(f"cache {info.name!r}: {what} nests deeper than {MAX_NESTING} levels")
    return raw


_decoder = msgspec.msgpack.Decoder()


_CREATE, _UPDATE, _DELETE = Op.CREATE, Op.UPDATE, Op.DELETE  # Op.X costs ~150 ns per access on 3.11


def _now_ms() -> int:
    """Wall-clock milliseconds: expire times are absolute (Ignite's), so they mean the same on a replica."""
    return time.time_ns() // 1_000_000


MAX_EXPIRE_TIME_MS = 2**63 - 1
"""Expire times are stored as unsigned 64-bit numbers; beyond this a peer's value is refused."""
MAX_TTL_MS = 100 * 365 * 86_400_000
"""A century: a longer TTL is a unit mistake (seconds or microseconds), not a wish."""


def _expire_time(info: CacheInfo, ttl_ms: int | None, now_ms: int) -> int:
    """The expire time of an entry put now (0: never): ``ttl_ms``, else the cache's default."""
    ttl = info.config.ttl_ms if ttl_ms is None else ttl_ms
    if not 0 <= ttl <= MAX_TTL_MS:
        raise ValueError(f"cache {info.name!r}: ttl_ms must be 0 (never) to {MAX_TTL_MS}, got {ttl}")
    return now_ms + ttl if ttl else 0


_CDC_DISABLED_KEY = b"cdc_disabled"
"""Metastorage flag of the runtime CDC switch."""


class NodeLocked(LockHeld):
    pass


class Node:
    """An embedded, persistent key-value node. Open with ``Node.open``; all methods are thread-safe.

    Writes append a DataRecord to the WAL and update an in-memory dirty map; a checkpointer thread
    moves the dirty map into LMDB (one synced transaction, together with the WAL pointer the
    checkpoint covers), so LMDB always holds a consistent state and recovery replays the WAL
    from that pointer.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._closed = False
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # writers wait here while the dirty map is full
        self._checkpoint_lock = threading.Lock()
        self._cdc_switch_lock = threading.Lock()
        self._checkpoint_wake = threading.Event()
        self._stop = threading.Event()
        self._dirty: dict[bytes, DataEntry] = {}
        self._snapshot: dict[bytes, DataEntry] | None = None  # being written by a checkpoint
        self._checkpoint_segment = 0
        self._expire_after: bytes | None = None
        """The expirer's place in the store's expiry index (rows it already handled until the next checkpoint)."""
        self._cp_appends = -1
        self._failure: BaseException | None = None
        self._dirty_hard_limit = 2 * config.checkpoint_dirty_max_entries
        self.stats = metrics.NodeStats()

        # The node dir first: created as a parent of the others it would get the umask's mode, not 0700.
        for d in (Path(config.node_dir), config.wal_path, config.archive_path, config.db_path):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        if config.cdc_enabled:
            config.cdc_path.mkdir(parents=True, exist_ok=True, mode=0o700)
            check_same_filesystem(config.archive_path, config.cdc_path)

        self._dir_lock = DirLock(config.lock_path)
        try:
            self._dir_lock.acquire(0)
        except LockHeld as exc:
            raise NodeLocked(exc.path, exc.pid) from None
        try:
            self._open()
        except BaseException:
            # Undo whatever _open() got to, in reverse order, so a retry in this process works.
            for attr, method in (
                ("replication", "stop"),
                ("_control_server", "stop"),
                ("realtime", "close"),
                ("_wal", "close"),
                ("_metastorage", "close"),
                ("_store", "close"),
            ):
                part = getattr(self, attr, None)
                if part is not None:
                    getattr(part, method)()
            self._dir_lock.release()
            raise

    def _open(self) -> None:
        config = self.config
        # Before anything is written: a control_socket another live node serves is a config error.
        self._control_server = ControlServer(config.control_socket_path, self._control)
        self._control_server.check_free()
        self._store = PageStore(config.db_path, config.lmdb_map_size_bytes)
        self.node_id = self._store.node_id()
        write_node_id(config.node_dir, self.node_id)
        cp = self._store.checkpoint()
        t0 = time.perf_counter()
        state = recover(
            work_dir=config.wal_path,
            archive_dir=config.archive_path,
            checkpoint=cp,
            caches=self._store.caches(),
            purge_cache=lambda info: self._store.purge_cache(info.cache_id, info.name),
        )
        self._dirty = state.dirty
        self._caches: dict[str, CacheInfo] = state.caches
        self._order = state.next_order - 1
        self._checkpoint_segment = cp.pointer.segment if cp is not None else 0
        self.stats.recovery_records = state.records
        metrics.register_node(self.stats)
        self._metastorage = Metastorage(config.metastorage_path)
        self._archiver = archiver = Archiver(
            config.archive_path,
            config.cdc_path,
            cdc_enabled=config.cdc_enabled,
            cdc_dir_max_bytes=config.cdc_dir_max_bytes,
            archive_max_bytes=config.archive_max_bytes,
            min_kept_segment=lambda: self._checkpoint_segment,
        )
        archiver.links_on = not self._metastorage.get_flag(_CDC_DISABLED_KEY)
        metrics.CDC_DISABLED.set(0 if archiver.links_on else 1)
        if config.cdc_enabled and not archiver.links_on:
            log.warning("cdc_disabled", hint="archived segments are not linked for CDC until `cdcd control cdc on`")
        for idx, path in state.closed_segments:
            log.info("finishing_interrupted_archive", segment=idx)
            archiver.archive(idx, path)
        self._wal = WalLog(
            work_dir=config.wal_path,
            node_id=self.node_id,
            position=state.position,
            segment_size_bytes=config.wal_segment_size_bytes,
            buffer_bytes=config.wal_buffer_bytes,
            flush_interval_ms=config.wal_flush_interval_ms,
            force_archive_timeout_ms=config.wal_force_archive_timeout_ms,
            archiver=archiver,
        )
        self.realtime = RealtimeWorker(
            config=config,
            wal=self._wal,
            metastorage=self._metastorage,
            caches=lambda: {info.cache_id: info for info in self._caches.values()},
            node_id=str(self.node_id),
        )
        self._wal.add_flush_listener(self.realtime.offer)
        self._wal.start()
        # Restores or starts realtime CDC, or (off) writes the Stop record that makes the daemon ACTIVE.
        self.realtime.open(state.position)
        self._control_server.start()
        self.replication: ReplicationServer | None = None
        if config.replication_listen:
            self.replication = self._replication_server()
            self.replication.start()
        self._fsync_commits = config.wal_mode == "fsync"
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="cdcd-checkpointer", daemon=True)
        self._checkpointer.start()
        log.info(
            "node_opened",
            node_dir=config.node_dir,
            node_id=str(self.node_id),
            wal_position=str(state.position),
            checkpoint=str(cp.pointer) if cp else None,
            records_replayed=state.records,
            replay_ms=round((time.perf_counter() - t0) * 1000, 1),
            wal_mode=config.wal_mode,
        )

    # --- opening and closing ---------------------------------------------------------------------
    @classmethod
    def open(cls, node_dir: str | Path, **settings: Any) -> Node:
        """Open (creating if needed) the node at ``node_dir``; ``settings`` are NodeConfig fields."""
        config = convert({"node_dir": str(node_dir), **settings}, NodeConfig, "Node.open()")
        return cls(config)

    @classmethod
    def from_config_file(cls, path: str | Path, **overrides: Any) -> Node:
        return cls(load_toml(path, NodeConfig, overrides))

    def close(self) -> None:
        """Flush, checkpoint and release the node dir (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._checkpoint_wake.set()
        self._checkpointer.join()
        with self._lock:
            self._room.notify_all()  # writers waiting for room (no checkpointer now) see the close and fail
        if self.replication is not None:
            self.replication.stop()
        self._control_server.stop()
        try:
            if self._failure is None:
                self.checkpoint()
            self.realtime.close()
            if self._failure is None:
                # Ignite rolls over on stop: the daemon sees the last writes (and the markers above)
                # now, not at the next open. A segment holding only the closing checkpoint stays.
                rolled = self._wal.force_archive(only_news=True)
                if rolled is not None:
                    log.info("segment_rolled_on_close", segment=rolled)
        finally:
            self._wal.close()
            self._metastorage.close()
            self._store.close()
            self._dir_lock.release()
            metrics.unregister_node(self.stats)
            log.info("node_closed", node_dir=self.config.node_dir)

    def __enter__(self) -> Node:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- caches ----------------------------------------------------------------------------------
    def cache(self, name: str, *, partitions: int | None = None, cdc_enabled: bool = True, ttl_ms: int = 0) -> Cache:
        """The cache called ``name``, created (and recorded in the WAL) on first use; the settings
        apply to a new cache only. ``ttl_ms``: default time to live of its entries (0: none)."""
        info = self._caches.get(name)
        if info is not None:
            return Cache(self, info)
        if not name or len(name) > 255 or "/" in name or "=" in name:
            raise ValueError(f"bad cache name {name!r}: 1-255 characters, no '/' or '='")
        if not 0 <= ttl_ms <= MAX_TTL_MS:
            raise ValueError(f"cache {name!r}: ttl_ms must be 0 (entries never expire) to {MAX_TTL_MS}, got {ttl_ms}")
        with self._lock:
            self._check_open()
            info = self._caches.get(name)
            if info is None:
                cache_id = zlib.crc32(name.encode()) & 0x7FFFFFFF
                for other in self._caches.values():
                    if other.cache_id == cache_id:
                        raise ValueError(f"cache name {name!r} hashes to the id of cache {other.name!r}; pick another")
                config = CacheConfig(
                    partitions=partitions or self.config.partitions, cdc_enabled=cdc_enabled, ttl_ms=ttl_ms
                )
                info = CacheInfo(cache_id, name, config)
                rec = CacheRecord(cache_id, name, CacheOp.CREATE, config, time.time_ns())
                _ptr, end = self._wal.append(rec)
                self._caches[name] = info
                log.info("cache_created", cache=name, cache_id=cache_id, partitions=config.partitions, ttl_ms=ttl_ms)
            else:
                end = None
        if end is not None and self._fsync_commits:
            self._wal.wait_durable(end)
        return Cache(self, info)

    def caches(self) -> list[str]:
        return sorted(self._caches)

    def destroy_cache(self, name: str) -> bool:
        """Destroy a cache and all its data (a CacheRecord DESTROY in the WAL). False if absent."""
        with self._checkpoint_lock, self._lock:
            self._check_open()
            info = self._caches.get(name)
            if info is None:
                return False
            rec = CacheRecord(info.cache_id, name, CacheOp.DESTROY, info.config, time.time_ns())
            _ptr, end = self._wal.append(rec)
            del self._caches[name]
            prefix = cache_prefix(info.cache_id)
            for key in [k for k in self._dirty if k.startswith(prefix)]:
                del self._dirty[key]
            # WAL before data: the purge may only reach LMDB once the DESTROY record is durable.
            # Holding the lock keeps readers from seeing purged rows meanwhile.
            self._wal.wait_durable(end)
            self._store.purge_cache(info.cache_id, name)
            self._store.renew_reader()
        log.info("cache_destroyed", cache=name, cache_id=info.cache_id)
        return True

    def transaction(self) -> Transaction:
        return Transaction(self)

    # --- WAL -------------------------------------------------------------------------------------
    def force_archive(self) -> int | None:
        """Roll the active segment now (if it holds records); returns the archived segment index."""
        self._check_open()
        return self._wal.force_archive()

    def flush(self) -> None:
        """Make every write so far durable (useful in background mode)."""
        self._wal.flush()

    @property
    def wal_position(self) -> WalPointer:
        return self._wal.position

    @property
    def wal(self) -> WalLog:
        return self._wal

    # --- reads and writes ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"node {self.config.node_dir} is closed")
        if self._failure is not None:
            raise RuntimeError(f"node {self.config.node_dir} failed: {self._failure}") from self._failure

    def _get(self, info: CacheInfo, key: Any, default: Any) -> Any:
        full_key = cache_prefix(info.cache_id) + _key_encoder.encode(key)
        with self._lock:
            e = self._pending_locked(full_key)
        if e is not None:
            if e.op == Op.DELETE or 0 < e.expire_time_ms <= _now_ms():
                return default
            return _decoder.decode(e.value)
        stored = self._store.get(full_key)
        if stored is None or 0 < stored.expire_time_ms <= _now_ms():
            return default  # an expired entry is gone at once; the expirer writes its DELETE later
        return _decoder.decode(stored.value)

    def _current(self, info: CacheInfo) -> dict[bytes, tuple[bytes, CacheVersion, int]]:
        """Every live (not expired) entry of a cache: key bytes -> (value bytes, version, expire_time_ms)."""
        prefix = cache_prefix(info.cache_id)
        plen = len(prefix)
        with self._lock:
            overlay: dict[bytes, DataEntry] = {}
            if self._snapshot is not None:
                overlay.update((k[plen:], e) for k, e in self._snapshot.items() if k.startswith(prefix))
            overlay.update((k[plen:], e) for k, e in self._dirty.items() if k.startswith(prefix))
            stored = list(self._store.items(info.cache_id))
        now_ms = _now_ms()
        merged = {k: (bytes(v.value), v.version, v.expire_time_ms) for k, v in stored}
        for k, e in overlay.items():
            if e.op == Op.DELETE:
                merged.pop(k, None)
            else:
                merged[k] = (bytes(e.value), e.version, e.expire_time_ms)
        for k in [k for k, (_v, _ver, expire) in merged.items() if 0 < expire <= now_ms]:
            del merged[k]
        return merged

    def _items(self, info: CacheInfo, decode: bool = True) -> Iterator[tuple[Any, Any]]:
        merged = self._current(info)
        for k in sorted(merged):
            value = merged[k][0]
            yield (_decoder.decode(k), _decoder.decode(value)) if decode else (k, value)

    def raw_items(self, cache: str) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) MessagePack bytes of every live entry of ``cache``, in key order."""
        info = self._caches.get(cache)
        if info is None:
            return iter(())
        return self._items(info, decode=False)

    def resend(self, cache: str) -> int:
        """Write every current entry of ``cache`` to the WAL as CREATE events with its version
        (Ignite's ``--cdc resend``): seeds a new consumer, or refills what lost links dropped.
        A cache with ``cdc_enabled = false`` is refused (ValueError).

        Each record's values are read under the write lock it is appended under, so a write that
        lands meanwhile comes after the resent value in the WAL, never before it (a consumer
        applying in WAL order ends with the current value). Returns the entries written."""
        info = self._caches.get(cache)
        if info is None:
            raise ValueError(f"no cache {cache!r} (caches: {', '.join(self.caches()) or 'none'})")
        if not info.config.cdc_enabled:
            # Ignite refuses it too: resent entries would be the only ones of the cache to leave it.
            raise ValueError(f"cache {cache!r} has cdc_enabled = false: its changes are never captured, none resent")
        prefix = cache_prefix(info.cache_id)
        keys = sorted(self._current(info))
        record_bytes = min(1 << 20, self.config.wal_segment_size_bytes // 4)
        end = None
        sent = 0
        i = 0
        while i < len(keys):
            with self._lock:
                self._check_open()
                entries: list[DataEntry] = []
                size = 0
                while i < len(keys) and size < record_bytes:
                    k = keys[i]
                    i += 1
                    current = self._current_locked(prefix + k)
                    if current is None:  # removed since the key list was taken: its DELETE is in the WAL
                        continue
                    value, version, expire = current
                    if 0 < expire <= _now_ms():  # expired meanwhile: its DELETE comes from the expirer
                        continue
                    partition = zlib.crc32(k) % info.config.partitions
                    entries.append(
                        DataEntry(
                            info.cache_id, _CREATE, msgspec.Raw(k), msgspec.Raw(value), partition, version, True, expire
                        )
                    )
                    size += len(k) + len(value) + 32
                if entries:
                    _ptr, end = self._wal.append(DataRecord(entries, time.time_ns()))
                    sent += len(entries)
        if end is not None:
            self._wal.wait_durable(end)
        log.info("cache_resent", cache=cache, entries=sent)
        return sent

    def _pending_locked(self, full_key: bytes) -> DataEntry | None:
        """The newest write of a key not yet in the page store (dirty map, then the checkpoint's
        snapshot); the caller holds ``_lock``."""
        e = self._dirty.get(full_key)
        if e is None and self._snapshot is not None:
            e = self._snapshot.get(full_key)
        return e

    def _current_locked(self, full_key: bytes) -> tuple[bytes, CacheVersion, int] | None:
        """(value, version, expire) of a live entry, None if absent; the caller holds ``_lock``."""
        e = self._pending_locked(full_key)
        if e is not None:
            return None if e.op == Op.DELETE else (bytes(e.value), e.version, e.expire_time_ms)
        stored = self._store.get_locked(full_key)  # a read txn per key was ~18% of a replicated apply
        return None if stored is None else (bytes(stored.value), stored.version, stored.expire_time_ms)

    # --- replication -------------------------------------------------------------------------------
    def _replication_server(self) -> ReplicationServer:
        config = self.config
        source = f"node {config.node_dir}"
        resolver = load_resolver(config.replication_resolver, config.cluster_id, config.conflict_resolve_field, source)
        return ReplicationServer(
            split_host_port(config.replication_listen, min_port=0),  # checked by NodeConfig
            token=credentials.read_token(config.replication_token_file, "replication_token_file", source),
            apply=lambda request: self.stage_replicated(request, resolver),
            wait_durable=self._wal.wait_durable,
            welcome=Welcome(config.cluster_id, str(self.node_id)),
            tls=credentials.server_context(
                config.replication_tls_cert, config.replication_tls_key, config.replication_tls_ca, source
            ),
            max_frame_bytes=config.replication_max_frame_bytes,
            max_connections=config.replication_max_connections,
            auth_timeout_s=config.replication_auth_timeout_ms / 1000,
        )

    def apply_replicated(self, request: Apply, resolver: ConflictResolver) -> Applied:
        """Apply another cluster's changes through ``resolver``; durable when this returns.

        Accepted entries are written as one DataRecord with this node's versions, each keeping its
        origin version in ``other_cluster_version`` (so no daemon sends it back). Raises
        RequestRefused, and applies nothing, if any entry is malformed."""
        reply, end = self.stage_replicated(request, resolver)
        if end is not None:
            self._wal.wait_durable(end)  # whatever wal_mode: the sender commits its position on our reply
        return reply

    def stage_replicated(self, request: Apply, resolver: ConflictResolver) -> tuple[Applied, WalPointer | None]:
        """``apply_replicated`` without the wait: the reply, and the WAL end that must be durable
        before it is sent (None: nothing was written)."""
        prepared = _prepare_replicated(request)
        if not prepared:
            return Applied(request.seq, 0, 0), None
        info = self._caches.get(request.cache)
        if info is None:
            try:
                info = self.cache(request.cache, partitions=request.partitions or None).info
            except ValueError as exc:
                raise RequestRefused(str(exc)) from None
        prefix = cache_prefix(info.cache_id)
        config = self.config
        node_order, cluster_id, topology_version = config.node_order, config.cluster_id, config.topology_version
        counts = dict.fromkeys(Rule, 0)
        applied = rejected = duplicates = 0
        end = None
        with self._lock:
            dirty = self._dirty_with_room_locked()
            if self._caches.get(info.name) is not info:
                raise RequestRefused(f"cache {info.name!r} was destroyed while applying")
            # Keys repeat within a request only from foreign senders (ours close a request on a
            # repeat): only then must each lookup see the request's own earlier entries.
            repeats = len({k for k, _n in prepared}) != len(prepared)
            latest: dict[bytes, tuple[bytes, CacheVersion, int] | None] = {}
            entries: list[DataEntry] = []
            keys: list[bytes] = []
            add_entry, add_key = entries.append, keys.append
            op_counts = {_CREATE: 0, _UPDATE: 0, _DELETE: 0}
            order = self._order
            lookup, resolve = self._current_locked, resolver.resolve
            name, cache_id, partitions = info.name, info.cache_id, info.config.partitions
            for key_raw, new in prepared:
                full_key = prefix + key_raw
                current = latest[full_key] if repeats and full_key in latest else lookup(full_key)
                held = None if current is None else Held(current[0], origin_version(current[1]), current[2])
                verdict = resolve(name, key_raw, held, new)
                if verdict.duplicate:
                    duplicates += 1
                    continue
                counts[verdict.rule] += 1
                if not verdict.use_new:
                    rejected += 1
                    continue
                applied += 1
                if new.op is _DELETE:
                    if current is None:
                        continue
                    op = _DELETE
                else:
                    op = _UPDATE if current is not None else _CREATE
                op_counts[op] += 1
                order += 1
                version = CacheVersion(order, node_order, cluster_id, topology_version, new.version)
                add_entry(
                    DataEntry(
                        cache_id,
                        op,
                        msgspec.Raw(key_raw),
                        new.value,
                        zlib.crc32(key_raw) % partitions,
                        version,
                        True,
                        new.expire_time_ms,
                    )
                )
                add_key(full_key)
                if repeats:
                    latest[full_key] = None if op is _DELETE else (bytes(new.value), version, new.expire_time_ms)
            if entries:
                _ptr, end = self._wal.append(DataRecord(entries, time.time_ns()))
                self._order = order
                dirty.update(zip(keys, entries, strict=True))
                stats = self.stats
                stats.transactions += 1
                for op, n in op_counts.items():
                    stats.entries[op] += n
                if len(dirty) >= config.checkpoint_dirty_max_entries:
                    self._checkpoint_wake.set()
        for rule, n in counts.items():
            if n:
                metrics.REPL_RECEIVED.labels(rule.name.lower()).inc(n)
        if duplicates:
            metrics.REPL_RECEIVED.labels("duplicate").inc(duplicates)
        if rejected:
            metrics.REPL_REJECTED.inc(rejected)
        return Applied(request.seq, applied, rejected, duplicates), end

    # --- the CDC switch ---------------------------------------------------------------------------
    @property
    def cdc_links_on(self) -> bool:
        """False while the runtime CDC switch is off (``cdcd control cdc off``)."""
        return self.config.cdc_enabled and self._archiver.links_on

    def set_cdc_links(self, on: bool) -> WalPointer:
        """Ignite's ``cdc.disabled``, the brake for a CDC dir filling the disk: stop (or resume)
        linking archived segments into the CDC dir, from the active segment on. Persisted before it
        takes effect, so it survives a restart. The daemon reports the segments archived meanwhile
        as a gap (``missing segment N``). Returns the WAL position at the switch."""
        self._check_open()
        if not self.config.cdc_enabled:
            raise ValueError("CDC is off in the node config (cdc_enabled = false): there is nothing to switch")
        with self._cdc_switch_lock:  # one switch at a time; the flusher reads links_on without a lock
            self._metastorage.put_flag(_CDC_DISABLED_KEY, not on)
            was = self._archiver.links_on
            self._archiver.links_on = on
            position = self._wal.position
        metrics.CDC_DISABLED.set(0 if on else 1)
        if was != on:
            log.warning(
                "cdc_switched",
                state="on" if on else "off",
                wal_position=str(position),
                hint="segments archived while CDC was off are a gap for the daemon"
                if on
                else "archived segments are not linked for CDC until `cdcd control cdc on`",
            )
        return position

    # --- control socket --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What ``cdcd control status`` prints: realtime state, daemon state, lag."""
        rt = self.realtime.status()
        wal_pos = self._wal.position
        daemon = read_daemon_state(self.config.daemon_state_path)
        delivering = "node" if rt["mode"] == "on" else "daemon"
        committed = self.realtime.position if delivering == "node" else daemon_position(daemon)
        lag_ms = None
        if delivering == "node" and rt["last_event_commit_ts_ns"]:
            lag_ms = max(0.0, (time.time_ns() - rt["last_event_commit_ts_ns"]) / 1e6)
        return {
            "node_dir": self.config.node_dir,
            "node_id": str(self.node_id),
            "wal_position": str(wal_pos),
            "last_archived_segment": self._wal.last_archived,
            "cdc": "on" if self.cdc_links_on else "off" if self.config.cdc_enabled else "disabled in config",
            "cdc_links_skipped": len(self._archiver.skipped_links),
            "realtime": rt,
            "daemon": daemon,
            "delivering": delivering,
            "lag_segments": max(0, wal_pos.segment - committed.segment) if committed is not None else None,
            "lag_ms": lag_ms,
            "realtime_consumer": mask_mapping(self.config.realtime_consumer),
            "cluster_id": self.config.cluster_id,
            "replication": self.replication.status() if self.replication is not None else None,
        }

    def _control(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req["cmd"]
        if cmd == "realtime":
            state = req.get("state")
            try:
                if state == "on":
                    mode = self.realtime.request_on()
                elif state == "off":
                    mode = self.realtime.wait_off(self.realtime.request_off(), timeout_s=2.0)
                    if mode is not RealtimeMode.OFF:  # a long batch (a big lake write) is finishing first
                        return {"realtime": "stopping"}
                else:
                    raise ControlError("realtime: state must be 'on' or 'off'")
            except RealtimeError as exc:
                raise ControlError(str(exc)) from None
            return {"realtime": mode.value}
        if cmd == "cdc":
            state = req.get("state")
            if state not in ("on", "off"):
                raise ControlError("cdc: state must be 'on' or 'off'")
            try:
                position = self.set_cdc_links(state == "on")
            except ValueError as exc:
                raise ControlError(str(exc)) from None
            return {"cdc": state, "wal_position": str(position)}
        if cmd == "status":
            return self.status()
        if cmd == "digest":
            return {"caches": digests(self)}
        if cmd == "resend":
            cache = req.get("cache")
            if not isinstance(cache, str):
                raise ControlError('resend: expected {"cache": NAME}')
            try:
                return {"resent": self.resend(cache), "cache": cache}
            except ValueError as exc:
                raise ControlError(str(exc)) from None
        raise ControlError(f"unknown command {cmd!r} (one of: realtime, cdc, status, resend, digest)")

    def _dirty_with_room_locked(self) -> dict[bytes, DataEntry]:
        """The dirty map, once it has room: writers wait for a checkpoint beyond twice its bound."""
        self._check_open()
        while len(self._dirty) >= self._dirty_hard_limit:
            self._checkpoint_wake.set()
            self._room.wait()
            self._check_open()
        return self._dirty

    def _put_one(self, info: CacheInfo, key: Any, value: Any, ttl_ms: int | None = None) -> None:
        """``Cache.put``: ``_commit`` of a single put without the batch bookkeeping."""
        if value is None:
            raise ValueError(f"cache {info.name!r}: value must not be None (use remove)")
        key_raw = _encode(_key_encoder, key, info, "key")
        value_raw = msgspec.Raw(_encode(_value_encoder, value, info, "value"))
        full_key = cache_prefix(info.cache_id) + key_raw
        partition = zlib.crc32(key_raw) % info.config.partitions
        config = self.config
        now_ms = _now_ms()
        expire = _expire_time(info, ttl_ms, now_ms)
        with self._lock:
            dirty = self._dirty_with_room_locked()
            if self._caches.get(info.name) is not info:
                raise ValueError(f"cache {info.name!r} was destroyed")
            e = dirty.get(full_key)
            if e is None and self._snapshot is not None:
                e = self._snapshot.get(full_key)
            if e is not None:  # an expired entry counts as gone: this put creates the key anew
                exists = e.op is not _DELETE and not 0 < e.expire_time_ms <= now_ms
            else:
                exists = self._store.live_locked(full_key, now_ms)
            op = _UPDATE if exists else _CREATE
            self._order = order = self._order + 1
            entry = DataEntry(
                info.cache_id,
                op,
                msgspec.Raw(key_raw),
                value_raw,
                partition,
                CacheVersion(order, config.node_order, config.cluster_id, config.topology_version),
                True,
                expire,
            )
            _ptr, end = self._wal.append(DataRecord([entry], time.time_ns()))
            dirty[full_key] = entry
            stats = self.stats
            stats.transactions += 1
            stats.entries[op] += 1
            if len(dirty) >= config.checkpoint_dirty_max_entries:
                self._checkpoint_wake.set()
        if self._fsync_commits:
            self._wal.wait_durable(end)

    def _commit(self, writes: Sequence[tuple[CacheInfo, Any, Any, int | None]]) -> int:
        """Write one DataRecord of puts/removes (each with its ttl_ms, None: the cache's); returns
        the number of entries written."""
        # Encoding, keys and partitions need no lock: prepare them before taking it.
        prepared = []
        now_ms = _now_ms()
        for info, key, value, ttl_ms in writes:
            if value is None:
                raise ValueError(f"cache {info.name!r}: value must not be None (use remove)")
            key_raw = _encode(_key_encoder, key, info, "key")
            value_raw = NIL if value is REMOVE else msgspec.Raw(_encode(_value_encoder, value, info, "value"))
            prepared.append(
                (
                    info,
                    cache_prefix(info.cache_id) + key_raw,
                    key_raw,
                    value_raw,
                    zlib.crc32(key_raw) % info.config.partitions,
                    0 if value is REMOVE else _expire_time(info, ttl_ms, now_ms),
                )
            )
        if not prepared:
            return 0
        config = self.config
        stats = self.stats
        with self._lock:
            dirty = self._dirty_with_room_locked()
            caches = self._caches
            seen: dict[bytes, bool] = {}
            entries: list[DataEntry] = []
            keys: list[bytes] = []
            order = self._order
            node_order, cluster_id, topology_version = config.node_order, config.cluster_id, config.topology_version
            snapshot = self._snapshot
            live_stored = self._store.live_locked
            creates = updates = deletes = 0
            for info, full_key, key_raw, value_raw, partition, expire in prepared:
                if caches.get(info.name) is not info:
                    raise ValueError(f"cache {info.name!r} was destroyed")
                if full_key in seen:
                    exists = seen[full_key]
                else:
                    e = dirty.get(full_key)
                    if e is None and snapshot is not None:
                        e = snapshot.get(full_key)
                    if e is not None:  # an expired entry counts as gone (a remove writes nothing)
                        exists = e.op is not _DELETE and not 0 < e.expire_time_ms <= now_ms
                    else:
                        exists = live_stored(full_key, now_ms)
                if value_raw is NIL:
                    if not exists:
                        continue
                    op = _DELETE
                    deletes += 1
                    seen[full_key] = False
                else:
                    if exists:
                        op = _UPDATE
                        updates += 1
                    else:
                        op = _CREATE
                        creates += 1
                    seen[full_key] = True
                order += 1
                entries.append(
                    DataEntry(
                        info.cache_id,
                        op,
                        msgspec.Raw(key_raw),
                        value_raw,
                        partition,
                        CacheVersion(order, node_order, cluster_id, topology_version),
                        True,
                        expire,
                    )
                )
                keys.append(full_key)
            if not entries:
                return 0
            _ptr, end = self._wal.append(DataRecord(entries, time.time_ns()))
            self._order = order
            stats.transactions += 1
            dirty.update(zip(keys, entries, strict=True))
            counts = stats.entries
            counts[_CREATE] += creates
            counts[_UPDATE] += updates
            counts[_DELETE] += deletes
            if len(dirty) >= config.checkpoint_dirty_max_entries:
                self._checkpoint_wake.set()
        if self._fsync_commits:
            self._wal.wait_durable(end)
        return len(entries)

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> WalPointer | None:
        """Move the dirty map into LMDB; returns the Checkpoint record's pointer (None if nothing changed)."""
        with self._checkpoint_lock:
            with self._lock:
                if not self._dirty and self._wal.appends == self._cp_appends:
                    return None  # nothing appended since the last checkpoint (rolls do not count)
                snapshot, self._dirty = self._dirty, {}
                self._checkpoint_wake.clear()  # commits up to here are covered; later ones may wake us again
                self._snapshot = snapshot
                caches = dict(self._caches)
                next_order = self._order + 1
                ts = time.time_ns()
                ptr, end = self._wal.append(Checkpoint(ts, next_order))
                self._cp_appends = self._wal.appends
                self._room.notify_all()
            t0 = time.perf_counter()
            try:
                self._wal.wait_durable(end)  # WAL before data
                self._store.write_checkpoint(snapshot, caches, CheckpointMeta(ptr, next_order, ts))
            finally:
                with self._lock:
                    self._snapshot = None
                    self._store.renew_reader()
            self._checkpoint_segment = ptr.segment
            self._expire_after = None  # the DELETEs written so far are in the store: their rows are gone
            metrics.CHECKPOINTS.inc()
            metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - t0)
            log.debug("checkpoint", pointer=str(ptr), entries=len(snapshot))
            return ptr

    def expire_entries(self) -> int:
        """Write DELETEs for stored entries whose expire time has passed, at most
        ``ttl_expire_batch_max_entries`` (one DataRecord, through the normal write path, so CDC,
        realtime and replication see them); returns how many. The checkpointer calls this every
        ``ttl_expire_interval_ms``.

        Candidates come from the store's expiry index, so memory stays bounded whatever the number
        of entries with a TTL; an entry still only in the dirty map gets there at the next
        checkpoint (``get`` hides it from its expire time on regardless). Each candidate is checked
        against the newest write of its key: an entry put again, or removed, meanwhile is left alone."""
        now_ms = _now_ms()
        config = self.config
        candidates = self._store.expired(now_ms, config.ttl_expire_batch_max_entries, self._expire_after)
        if not candidates:
            return 0
        end = None
        with self._lock:
            self._check_open()
            by_id = {info.cache_id: info for info in self._caches.values()}
            entries: list[DataEntry] = []
            keys: list[bytes] = []
            order = self._order
            for expire, full_key in candidates:
                current = self._current_locked(full_key)
                if current is None or current[2] != expire:
                    continue  # removed or put again since the last checkpoint
                info = by_id.get(int.from_bytes(full_key[:4], "big"))
                if info is None:
                    continue  # cache destroyed: its purge removes the row
                key_raw = full_key[4:]
                order += 1
                entries.append(
                    DataEntry(
                        info.cache_id,
                        _DELETE,
                        msgspec.Raw(key_raw),
                        NIL,
                        zlib.crc32(key_raw) % info.config.partitions,
                        # An entry replicated from another cluster keeps its origin: every cluster
                        # expires its own copy, and none sends its expiry back to the origin.
                        CacheVersion(
                            order,
                            config.node_order,
                            config.cluster_id,
                            config.topology_version,
                            current[1].other_cluster_version,
                        ),
                        True,
                        expire,
                    )
                )
                keys.append(full_key)
            if entries:
                _ptr, end = self._wal.append(DataRecord(entries, time.time_ns()))
                self._order = order
                # No wait for room here: this is the checkpointer's thread, the one that makes room.
                self._dirty.update(zip(keys, entries, strict=True))
                self.stats.transactions += 1
                self.stats.entries[_DELETE] += len(entries)
        self._expire_after = _expiry_index_key(*candidates[-1])
        if entries:
            metrics.TTL_EXPIRED.inc(len(entries))
            log.debug("entries_expired", entries=len(entries), through_ms=candidates[-1][0])
        if end is not None and self._fsync_commits:
            self._wal.wait_durable(end)
        return len(entries)

    def _checkpoint_loop(self) -> None:
        interval_s = self.config.checkpoint_interval_ms / 1000
        expire_interval_s = self.config.ttl_expire_interval_ms / 1000
        batch = self.config.ttl_expire_batch_max_entries
        now = time.monotonic()
        next_checkpoint, next_expire = now + interval_s, now + expire_interval_s
        while not self._stop.is_set():
            woken = self._checkpoint_wake.wait(max(0.0, min(next_checkpoint, next_expire) - time.monotonic()))
            self._checkpoint_wake.clear()
            if self._stop.is_set():
                return
            try:
                now = time.monotonic()
                if now >= next_expire:
                    # A full round may have left more: go again at once (checkpoints still interleave).
                    full = self.expire_entries() >= batch
                    next_expire = now if full else now + expire_interval_s
                if woken or now >= next_checkpoint or len(self._dirty) >= self.config.checkpoint_dirty_max_entries:
                    self.checkpoint()
                    next_checkpoint = time.monotonic() + interval_s
            except Exception as exc:
                self._failure = exc
                log.error("checkpoint_failed", error=f"{type(exc).__name__}: {exc}", node_dir=self.config.node_dir)
                with self._lock:
                    self._room.notify_all()
                return


def _expiry_index_key(expire_time_ms: int, full_key: bytes) -> bytes:
    return expire_time_ms.to_bytes(8, "big") + full_key


def _prepare_replicated(request: Apply) -> list[tuple[bytes, ReplEntry]]:
    """(canonical key bytes, entry) of every entry, checked as a local write would be: a peer
    must not be able to put what this node's own readers cannot decode into its WAL. (Frame
    decoding already proved every key and value well-formed MessagePack.)"""
    out = []
    nil = bytes(NIL)
    for i, e in enumerate(request.entries):
        if not 1 <= e.version.cluster_id <= 31:
            raise RequestRefused(
                f"cache {request.cache!r} entry {i}: origin cluster id {e.version.cluster_id} is not in 1-31"
            )
        if not 0 <= e.expire_time_ms <= MAX_EXPIRE_TIME_MS:
            raise RequestRefused(f"cache {request.cache!r} entry {i}: expire_time_ms {e.expire_time_ms} out of range")
        value = bytes(e.value)
        if (value == nil) is not (e.op is _DELETE):
            what = "a delete carries a value" if e.op is _DELETE else "a put without a value"
            raise RequestRefused(f"cache {request.cache!r} entry {i}: {what}")
        try:
            key = _decoder.decode(e.key)
            # Only long encodings can nest too deep (each level costs a byte): decode just those.
            if len(e.key) > MAX_NESTING and _too_deep(key):
                raise ValueError(f"key nests deeper than {MAX_NESTING} levels")
            if len(value) > MAX_NESTING and _too_deep(_decoder.decode(value)):
                raise ValueError(f"value nests deeper than {MAX_NESTING} levels")
            key_raw = _key_encoder.encode(key)  # canonical: equal keys, equal bytes, whoever encoded them
        except (msgspec.DecodeError, RecursionError, TypeError, ValueError) as exc:
            raise RequestRefused(f"cache {request.cache!r} entry {i}: {exc}") from None
        out.append((key_raw, e if e.version.other_cluster_version is None else _as_origin(e)))
    return out


def _as_origin(e: ReplEntry) -> ReplEntry:
    return ReplEntry(e.op, e.key, e.value, origin_version(e.version), e.expire_time_ms)


def open_node(node_dir: str | Path, **settings: Any) -> Node:
    return Node.open(node_dir, **settings)


__all__ = ["Cache", "ConfigError", "Node", "NodeConfig", "NodeLocked", "Transaction", "open_node"]
