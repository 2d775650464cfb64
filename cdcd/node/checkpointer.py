"""Checkpoints and TTL expiry: the node's background thread that moves the dirty map into LMDB."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable

import structlog

from cdcd import metrics
from cdcd.node.config import NodeConfig
from cdcd.node.store import CheckpointMeta, PageStore
from cdcd.node.wal_log import WalLog
from cdcd.node.writes import Change, Current, WriteCore, now_ms
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import NIL, CacheInfo, CacheVersion, Checkpoint, Op

log = structlog.get_logger("cdcd.node")

_DELETE = Op.DELETE
_TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Checkpoint failures that clear by themselves (space freed): retried, not fatal."""
_RETRY_MAX_S = 5.0


def transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


class Checkpointer:
    """Runs ``checkpoint`` every ``checkpoint_interval_ms`` (or when the dirty map fills) and
    ``expire_entries`` every ``ttl_expire_interval_ms``. A full disk is waited out (``blocked``
    says why; writers wait once the dirty map is full); any other failure stops it and is handed
    to ``on_failure`` (the node then refuses writes and ``cdcd node run`` exits 1)."""

    def __init__(
        self,
        *,
        config: NodeConfig,
        writes: WriteCore,
        store: PageStore,
        caches: dict[str, CacheInfo],
        segment: int,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.writes = writes
        self.store = store
        self.caches = caches
        self.segment = segment
        """The segment of the last checkpoint: older ones are no longer needed for recovery."""
        self._on_failure = on_failure
        self.blocked: str | None = None
        """Why checkpoints wait (a full disk), or None."""
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self._expire_after: bytes | None = None
        """The expirer's place in the store's expiry index (rows it already handled until the next checkpoint)."""
        self._cp_appends = -1
        self._thread = threading.Thread(target=self._run, name="cdcd-checkpointer", daemon=True)

    @property
    def wal(self) -> WalLog:
        assert self.writes.wal is not None
        return self.writes.wal

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Stop the thread (a checkpoint in progress finishes first)."""
        self.stop_event.set()
        self.writes.checkpoint_wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def checkpoint(self) -> WalPointer | None:
        """Move the dirty map into LMDB; returns the Checkpoint record's pointer (None if nothing changed)."""
        with self.lock:
            with self.writes.lock:
                if not self.writes.dirty and self.wal.appends == self._cp_appends:
                    return None  # nothing appended since the last checkpoint (rolls do not count)
                snapshot, self.writes.dirty = self.writes.dirty, {}
                self.writes.checkpoint_wake.clear()  # commits up to here are covered; later ones may wake us again
                self.writes.snapshot = snapshot
                caches = dict(self.caches)
                next_order = self.writes.order + 1
                ts = time.time_ns()
                ptr, end = self.wal.append(Checkpoint(ts, next_order))
                self._cp_appends = self.wal.appends
                self.writes.room.notify_all()
            t0 = time.perf_counter()
            try:
                self.wal.wait_durable(end)  # WAL before data
                self.store.write_checkpoint(snapshot, caches, CheckpointMeta(ptr, next_order, ts))
            except BaseException:
                # The store kept the previous checkpoint: the entries stay in memory for reads and
                # the next try (the WAL has them for recovery either way). Newer writes win.
                with self.writes.lock:
                    snapshot.update(self.writes.dirty)
                    self.writes.dirty = snapshot
                raise
            finally:
                with self.writes.lock:
                    self.writes.snapshot = None
                    self.store.renew_reader()
            self.segment = ptr.segment
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
        candidates = self.store.expired(now_ms(), self.config.ttl_expire_batch_max_entries, self._expire_after)
        if not candidates:
            return 0
        by_id = {info.cache_id: info for info in self.caches.values()}
        # A destroyed cache's purge removes its rows.
        changes: list[Change] = [
            (by_id[cid], full_key[4:], NIL, expire, None)
            for expire, full_key, _ in candidates
            if (cid := int.from_bytes(full_key[:4], "big")) in by_id
        ]

        def decide(change: Change, current: Current | None) -> tuple[Op, CacheVersion | None] | None:
            if current is None or current.expire_time_ms != change[3]:
                return None  # removed or put again since the last checkpoint
            # An entry replicated from another cluster keeps its origin: every cluster expires its
            # own copy, and none sends its expiry back to the origin.
            return _DELETE, current.version.other_cluster_version

        # No wait for room here: this is the checkpointer's thread, the one that makes room.
        entries, end = self.writes.write(changes, decide, wait_for_room=False, skip_destroyed=True)
        self._expire_after = candidates[-1][2]
        if entries:
            metrics.TTL_EXPIRED.inc(len(entries))
            log.debug("entries_expired", entries=len(entries), through_ms=candidates[-1][0])
        if end is not None and self.writes.fsync_commits:
            self.wal.wait_durable(end)
        return len(entries)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # Anything the loop does not handle (a bug, a failed wait) ends it like a failed checkpoint:
            # the node refuses writes and says why, instead of writers waiting for room forever.
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self._on_failure(exc)
        log.error("checkpoint_failed", error=f"{type(exc).__name__}: {exc}", node_dir=self.config.node_dir)
        with self.writes.lock:
            self.writes.room.notify_all()

    def _loop(self) -> None:
        interval_s = self.config.checkpoint_interval_ms / 1000
        expire_interval_s = self.config.ttl_expire_interval_ms / 1000
        batch = self.config.ttl_expire_batch_max_entries
        now = time.monotonic()
        next_checkpoint, next_expire = now + interval_s, now + expire_interval_s
        retry_s = 0.0
        while not self.stop_event.is_set():
            if self.blocked is not None:
                # Waiting for space: writers' wake-ups must not turn the backoff into a busy loop.
                if self.stop_event.wait(max(0.0, next_checkpoint - time.monotonic())):
                    return
                woken = True
            else:
                wake_at = min(next_checkpoint, next_expire)
                woken = self.writes.checkpoint_wake.wait(max(0.0, wake_at - time.monotonic()))
            self.writes.checkpoint_wake.clear()
            if self.stop_event.is_set():
                return
            try:
                now = time.monotonic()
                if now >= next_expire and self.blocked is None:
                    # A full round may have left more: go again at once (checkpoints still interleave).
                    full = self.expire_entries() >= batch
                    next_expire = now if full else now + expire_interval_s
                if (
                    woken
                    or now >= next_checkpoint
                    or len(self.writes.dirty) >= self.config.checkpoint_dirty_max_entries
                ):
                    self.checkpoint()
                    next_checkpoint = time.monotonic() + interval_s
                    if self.blocked is not None:
                        log.info("checkpoint_disk_space_back", node_dir=self.config.node_dir)
                        self.blocked, retry_s = None, 0.0
            except Exception as exc:
                if transient(exc):
                    if self.blocked is None:
                        log.warning(
                            "checkpoint_waiting_for_space",
                            error=f"{type(exc).__name__}: {exc}",
                            hint="writes resume once space is freed",
                        )
                    self.blocked = str(exc)
                    retry_s = min(max(retry_s * 2, 0.05), _RETRY_MAX_S)
                    next_checkpoint = time.monotonic() + retry_s
                    continue
                self._failed(exc)
                return
