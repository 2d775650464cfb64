"""The storage node: caches over LMDB, every change written ahead to a segmented WAL."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from cdcd import failpoints, metrics
from cdcd.config import ConfigError, convert, load_toml
from cdcd.control import ControlServer
from cdcd.lock import DirLock, LockHeld
from cdcd.node import attach, commands
from cdcd.node.archiver import Archiver, check_same_filesystem
from cdcd.node.cache import Cache
from cdcd.node.checkpointer import Checkpointer, transient
from cdcd.node.config import NodeConfig
from cdcd.node.identity import write_node_id
from cdcd.node.metastorage import Metastorage
from cdcd.node.recovery import recover
from cdcd.node.store import PageStore, cache_prefix
from cdcd.node.topology import open_topology_version
from cdcd.node.transaction import Transaction
from cdcd.node.wal_log import WalLog
from cdcd.node.writes import MAX_TTL_MS, WriteCore, decoder
from cdcd.version import version_and_commit
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import (
    CacheConfig,
    CacheInfo,
    CacheOp,
    CacheRecord,
    CacheVersion,
    Op,
)

log = structlog.get_logger("cdcd.node")

_CREATE, _DELETE = Op.CREATE, Op.DELETE

_CDC_DISABLED_KEY = b"cdc_disabled"
"""Metastorage flag of the runtime CDC switch."""


class NodeLocked(LockHeld):
    pass


class Node:
    """An embedded, persistent key-value node. Open with ``Node.open``; all methods are thread-safe.

    Writes (``writes``, the one write path) append a DataRecord to the WAL and update an in-memory
    dirty map; a checkpointer thread moves the dirty map into LMDB (one synced transaction,
    together with the WAL pointer the checkpoint covers), so LMDB always holds a consistent state
    and recovery replays the WAL from that pointer. Realtime delivery and the replication endpoint
    are attached (``cdcd.node.attach``): ``realtime`` and ``services`` default to the registered ones.
    """

    def __init__(
        self,
        config: NodeConfig,
        *,
        realtime: attach.RealtimeFactory | None = None,
        services: Mapping[str, attach.ServiceFactory] | None = None,
    ) -> None:
        self.config = config
        self._closed = False
        self._cdc_switch_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._realtime_factory = realtime or attach.default_realtime()
        self._service_factories = attach.default_services() if services is None else dict(services)
        self.services: dict[str, attach.Service] = {}
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
            for service in self.services.values():
                service.stop()
            for attr, method in (
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
        failpoints.hit("node.open.locked")  # tests: lock held, cdc dir made, no answer yet on socket or metastorage
        # Before anything is written: a control_socket another live node serves is a config error.
        self._control_server = ControlServer(config.control_socket_path, lambda req: commands.handle(self, req))
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
        self._caches: dict[str, CacheInfo] = state.caches
        self.writes = WriteCore(
            config=config,
            store=self._store,
            caches=self._caches,
            dirty=state.dirty,
            order=state.next_order - 1,
            # Before any write of this open: its versions sort above every version of earlier opens.
            topology_version=open_topology_version(self._store, config.topology_version),
            stats=self.stats,
            check_open=self._check_open,
        )
        self._checkpoint_wake = self.writes.checkpoint_wake
        self._checkpointer = Checkpointer(
            config=config,
            writes=self.writes,
            store=self._store,
            caches=self._caches,
            segment=cp.pointer.segment if cp is not None else 0,
            on_failure=self._fail,
        )
        self._stop = self._checkpointer.stop_event
        self.stats.recovery_records = state.records
        metrics.register_node(self.stats)
        self._metastorage = Metastorage(config.metastorage_path)
        self._archiver = archiver = Archiver(
            config.archive_path,
            config.cdc_path,
            cdc_enabled=config.cdc_enabled,
            cdc_dir_max_bytes=config.cdc_dir_max_bytes,
            archive_max_bytes=config.archive_max_bytes,
            min_kept_segment=lambda: self._checkpointer.segment,
        )
        archiver.links_on = not self._metastorage.get_flag(_CDC_DISABLED_KEY)
        metrics.CDC_DISABLED.set(0 if archiver.links_on else 1)
        if config.cdc_enabled and not archiver.links_on:
            log.warning("cdc_disabled", hint="archived segments are not linked for CDC until `cdcd control cdc on`")
        for idx, path in state.closed_segments:
            log.info("finishing_interrupted_archive", segment=idx)
            archiver.archive(idx, path)
        self._wal = self.writes.wal = WalLog(
            work_dir=config.wal_path,
            node_id=self.node_id,
            position=state.position,
            segment_size_bytes=config.wal_segment_size_bytes,
            buffer_bytes=config.wal_buffer_bytes,
            flush_interval_ms=config.wal_flush_interval_ms,
            force_archive_timeout_ms=config.wal_force_archive_timeout_ms,
            archiver=archiver,
        )
        self.realtime = self._realtime_factory(
            attach.NodeParts(
                config=config,
                wal=self._wal,
                metastorage=self._metastorage,
                caches=lambda: {info.cache_id: info for info in self._caches.values()},
                node_id=str(self.node_id),
            )
        )
        self.realtime.cdc_links(self.cdc_links_on or not config.cdc_enabled)
        self._wal.add_flush_listener(self.realtime.offer)
        self._wal.start()
        # Restores or starts realtime CDC, or (off) writes the Stop record that makes the daemon ACTIVE.
        self.realtime.open(state.position)
        self._control_server.start()
        for name, factory in self._service_factories.items():
            service = factory(self)
            if service is not None:
                self.services[name] = service
                service.start()
        self._checkpointer.start()
        log.info(
            "node_opened",
            node_dir=config.node_dir,
            node_id=str(self.node_id),
            topology_version=self.writes.topology_version,
            wal_position=str(state.position),
            checkpoint=str(cp.pointer) if cp else None,
            records_replayed=state.records,
            replay_ms=round((time.perf_counter() - t0) * 1000, 1),
            wal_mode=config.wal_mode,
            version=version_and_commit(),
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
        self.writes.accepting = False
        self._checkpointer.join()
        with self.writes.lock:
            self.writes.room.notify_all()  # writers waiting for room (no checkpointer now) see the close and fail
        for service in self.services.values():
            service.stop()
        self._control_server.stop()
        # A dead WAL flusher counts too: a checkpoint or a roll would only wait on it to fail.
        failed = self.failure is not None
        try:
            if not failed:
                try:
                    self.checkpoint()
                except OSError as exc:
                    if not transient(exc):
                        raise
                    # Nothing is lost: the WAL holds every write, and the next open replays it.
                    log.warning("closed_without_checkpoint", error=str(exc), hint="the next open replays the WAL")
            self.realtime.close()
            if not failed:
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

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        self.writes.accepting = False

    @property
    def failure(self) -> BaseException | None:
        """Why the node refuses writes for good (a failed checkpoint, a dead WAL flusher), or None."""
        return self._failure or self._wal.flusher_failure

    def writes_state(self) -> str:
        """``ok``, ``waiting for disk space: …`` (resumes by itself) or ``failed: …``."""
        failure = self.failure
        if failure is not None:
            return f"failed: {type(failure).__name__}: {failure}"
        blocked = self._checkpointer.blocked
        return f"waiting for disk space: {blocked}" if blocked is not None else "ok"

    # --- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> WalPointer | None:
        """Move the dirty map into LMDB; returns the Checkpoint record's pointer (None if nothing changed)."""
        return self._checkpointer.checkpoint()

    def expire_entries(self) -> int:
        """Write DELETEs for expired entries now (``Checkpointer.expire_entries``); returns how many."""
        return self._checkpointer.expire_entries()

    @property
    def replication(self) -> attach.Service | None:
        """The replication endpoint (None: ``replication_listen`` is not set)."""
        return self.services.get("replication")

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
        with self.writes.lock:
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
        if end is not None and self.writes.fsync_commits:
            self._wal.wait_durable(end)
        return Cache(self, info)

    def caches(self) -> list[str]:
        return sorted(self._caches)

    def cache_info(self, name: str) -> CacheInfo | None:
        """The cache called ``name`` if it exists (never creates it)."""
        return self._caches.get(name)

    def destroy_cache(self, name: str) -> bool:
        """Destroy a cache and all its data (a CacheRecord DESTROY in the WAL). False if absent."""
        with self._checkpointer.lock, self.writes.lock:
            self._check_open()
            info = self._caches.get(name)
            if info is None:
                return False
            w = self.writes
            # The next write's version: every entry before the drop is lower, every entry after it not.
            version = CacheVersion(w.order + 1, self.config.node_order, self.config.cluster_id, w.topology_version)
            rec = CacheRecord(info.cache_id, name, CacheOp.DESTROY, info.config, time.time_ns(), version)
            _ptr, end = self._wal.append(rec)
            del self._caches[name]
            prefix = cache_prefix(info.cache_id)
            for key in [k for k in self.writes.dirty if k.startswith(prefix)]:
                del self.writes.dirty[key]
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

    def _items(self, info: CacheInfo, decode: bool = True) -> Iterator[tuple[Any, Any]]:
        merged = self.writes.live_entries(info)
        for k in sorted(merged):
            value = merged[k][0]
            yield (decoder.decode(k), decoder.decode(value)) if decode else (k, value)

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
        sent, end = self.writes.resend(info, sorted(self.writes.live_entries(info)))
        if end is not None:
            self._wal.wait_durable(end)
        log.info("cache_resent", cache=cache, entries=sent)
        return sent

    # --- the CDC switch ---------------------------------------------------------------------------
    @property
    def cdc_links_on(self) -> bool:
        """False while the runtime CDC switch is off (``cdcd control cdc off``)."""
        return self.config.cdc_enabled and self._archiver.links_on

    def set_cdc_links(self, on: bool) -> tuple[WalPointer, bool]:
        """Ignite's ``cdc.disabled``, the brake for a CDC dir filling the disk: stop (or resume)
        linking archived segments into the CDC dir, from the active segment on. Persisted before it
        takes effect, so it survives a restart. The daemon reports the segments archived meanwhile
        as a gap (``missing segment N``). Off stops realtime capture too, as Ignite's does: its Stop
        record goes into a segment still linked, so the daemon delivers up to the switch and the gap
        is the same as without realtime. Returns the WAL position at the switch, and whether
        realtime capture stopped. Raises AttachError when it did not stop in time (links stay on)."""
        self._check_open()
        if not self.config.cdc_enabled:
            raise ValueError("CDC is off in the node config (cdc_enabled = false): there is nothing to switch")
        with self._cdc_switch_lock:  # one switch at a time; the flusher reads links_on without a lock
            stopped = not on and self._archiver.links_on and self.realtime.cdc_links(False)
            if stopped:
                self._wal.force_archive()  # archived and linked: the daemon reads the Stop record now
            self._metastorage.put_flag(_CDC_DISABLED_KEY, not on)
            was = self._archiver.links_on
            self._archiver.links_on = on
            position = self._wal.position
            if on:
                self.realtime.cdc_links(True)
        metrics.CDC_DISABLED.set(0 if on else 1)
        if was != on:
            log.warning(
                "cdc_switched",
                state="on" if on else "off",
                wal_position=str(position),
                hint="segments archived while CDC was off are a gap for the daemon"
                if on
                else "archived segments are not linked for CDC until `cdcd control cdc on`",
                realtime_stopped=stopped,
            )
        return position, stopped

    @property
    def cdc_links_skipped(self) -> int:
        """Archived segments not linked for CDC (the CDC dir was full)."""
        return len(self._archiver.skipped_links)

    def status(self) -> dict[str, Any]:
        """What ``cdcd control status`` prints: realtime state, daemon state, lag."""
        return commands.status(self)


def open_node(node_dir: str | Path, **settings: Any) -> Node:
    return Node.open(node_dir, **settings)


__all__ = ["Cache", "ConfigError", "Node", "NodeConfig", "NodeLocked", "Transaction", "open_node"]
