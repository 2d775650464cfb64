"""Realtime CDC inside the node (IEP-104, DESIGN §5): deliver changes right after each WAL flush.

The flusher offers every flushed chunk to ``offer`` (never blocking: over ``cdc_buffer_bytes`` the
worker stops and the daemon takes over). One worker thread decodes the chunks, hands batches to
the consumer, persists its position in the metastorage and writes marker records:
``RealtimeCdcRecord(last)`` (rate-limited) while it delivers, ``StopRealtimeCdcRecord(last)`` when
it stops, ``TryStartRealtimeCdcRecord`` (then a segment roll) when it wants to start again; it
delivers past a TryStart only once the daemon deleted that segment's link (it committed all
before). The two sides therefore never deliver interleaved.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog
from prometheus_client import REGISTRY

from cdcd import failpoints, metrics
from cdcd.consumer import Consumer, EventBatch
from cdcd.delivery import Batch, Batcher, CacheChange, record_entries
from cdcd.node.attach import AttachError, NodeParts
from cdcd.node.metastorage import RealtimeState
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import WalReader, iter_chunk
from cdcd.wal.records import (
    CacheRecord,
    DataRecord,
    RealtimeCdcRecord,
    Record,
    StopRealtimeCdcRecord,
    TryStartRealtimeCdcRecord,
)
from cdcd.wal.segment import segment_path
from cdcd.wal.writer import Chunk

log = structlog.get_logger("cdcd.realtime")

_POLL_S = 0.02
_NO_BYTE_BOUND = 1 << 62
"""Realtime batches are bounded by events only (the buffer already bounds the bytes)."""


class RealtimeMode(enum.Enum):
    OFF = "off"
    TRY_START = "try_start"
    """Buffering from a TryStart record, waiting for the daemon to pass it."""
    ON = "on"


class RealtimeError(AttachError):
    pass


ConsumerFactory = Callable[[Mapping[str, Any], str], Consumer]
"""Builds the consumer a ``realtime_consumer`` table describes (``cdcd.sinks.load_consumer``)."""


# A buffered source: a flushed chunk (decoded lazily) or records re-read from files at restore.
_Source = Chunk | list[tuple[WalPointer, Record, int]]


class RealtimeWorker:
    """The node's realtime attachment (``cdcd.node.attach.Realtime``)."""

    def __init__(self, parts: NodeParts, load_consumer: ConsumerFactory) -> None:
        self.config = config = parts.config
        self.wal = parts.wal
        self.meta = metastorage = parts.metastorage
        self._caches = parts.caches
        self.node_id = parts.node_id
        self._load_consumer = load_consumer
        self.buffer_limit_bytes = config.cdc_buffer_limit_bytes
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._meta_lock = threading.Lock()
        self._marker_lock = threading.Lock()
        """Held across every metastorage write and the marker or Stop record that follows it (taken
        before ``_meta_lock``): a marker being written finishes before a Stop is persisted."""
        self._marker_due = threading.Event()
        self._marker_thread: threading.Thread | None = None
        self._buffer: deque[_Source] = deque()
        self._buffered_bytes = 0
        self.buffer_max_used_bytes = 0
        self._overflow = False
        self._stop_reason: str | None = None
        self._closing = False
        self.mode = RealtimeMode.OFF
        saved = metastorage.get() or RealtimeState()
        self.state = saved
        self.position: WalPosition | None = saved.position
        self.try_start: WalPointer | None = saved.try_start
        self._deliver_from: WalPosition | None = None
        """Delivery resumes here: earlier records, and the entries of this one before its index, are done."""
        self._restore_until: WalPointer | None = None
        self.restored_records = 0
        self.stops: dict[str, int] = {}
        self.last_event_ts_ns = 0
        self._last_marker = 0.0
        self._unconfirmed = False
        """The consumer returned False: no position may be committed until it returns True."""
        self._batcher: Batcher | None = None
        """Batches and cache changes of the current run of deliveries (None: a new run begins)."""
        self._names: dict[int, str] = {}
        """Names of the node's caches, kept for events of a cache destroyed meanwhile."""
        self._consumer: Consumer | None = None
        self._thread: threading.Thread | None = None
        self._set_mode(RealtimeMode.OFF)

    # --- opening -------------------------------------------------------------------------------------
    def open(self, open_position: WalPointer) -> None:
        """Called once the WAL runs. Restores an enabled state, resumes a pending try-start, or starts
        one if configured; otherwise (and before any new TryStart) writes the Stop record the daemon
        needs to know it delivers."""
        saved = self.state
        if (saved.try_start is not None or saved.enabled) and not self.config.realtime_consumer:
            log.error("realtime_state_without_consumer", hint="realtime_consumer was removed from the config")
            if saved.try_start is not None:
                self.position = WalPosition(saved.try_start.segment + 1, 0, 0)
            self.try_start = None
            self._persist(enabled=False)
            saved = self.state
        if saved.try_start is not None:
            ts = saved.try_start
            self._enter(RealtimeMode.TRY_START, WalPosition(ts.segment + 1, 0, 0), open_position)
            log.info("realtime_try_start_resumed", try_start=str(ts))
        elif saved.enabled and saved.position is not None:
            self._enter(RealtimeMode.ON, saved.position, open_position)
            log.info("realtime_restoring", position=str(saved.position))
        else:
            last = saved.position
            self.wal.append(StopRealtimeCdcRecord(last, "node_start_realtime_off"))
            if self.config.realtime_cdc:
                self.request_on()
        self._thread = threading.Thread(target=self._run, name="cdcd-realtime", daemon=True)
        self._thread.start()
        self._marker_thread = threading.Thread(target=self._run_markers, name="cdcd-realtime-marker", daemon=True)
        self._marker_thread.start()

    def _enter(self, mode: RealtimeMode, deliver_from: WalPosition, open_position: WalPointer) -> None:
        self._ensure_consumer()
        self._deliver_from = deliver_from
        if deliver_from.pointer < open_position:
            self._restore_until = open_position
        self._set_mode(mode)

    def _ensure_consumer(self) -> Consumer:
        if self._consumer is None:
            if not self.config.realtime_consumer:
                raise RealtimeError("realtime CDC needs a realtime_consumer table in the node config")
            consumer = self._load_consumer(self.config.realtime_consumer, "realtime_consumer")
            consumer.start(REGISTRY)
            self._consumer = consumer
        return self._consumer

    # --- the flusher's side ----------------------------------------------------------------------------
    def offer(self, chunks: list[Chunk]) -> None:
        """Flusher thread: queue flushed chunks, never block. The chunks are the writer's own buffers,
        handed over and never touched again, so they need no copy."""
        with self._lock:
            if self.mode is RealtimeMode.OFF or self._overflow:
                return
            for chunk in chunks:
                size = len(chunk.data)
                if self._buffered_bytes + size > self.buffer_limit_bytes:
                    self._overflow = True
                    self._buffer.clear()
                    self._buffered_bytes = 0
                    metrics.RT_BUFFER_BYTES.set(0)
                    break
                self._buffer.append(chunk)
                self._buffered_bytes += size
            if self._buffered_bytes > self.buffer_max_used_bytes:
                self.buffer_max_used_bytes = self._buffered_bytes
                metrics.RT_BUFFER_MAX_USED_BYTES.set(self._buffered_bytes)
            metrics.RT_BUFFER_BYTES.set(self._buffered_bytes)
            self._cv.notify()

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_bytes

    # --- commands ----------------------------------------------------------------------------------------
    def request_on(self) -> RealtimeMode:
        """Try to start: write TryStart, roll the segment, buffer from there, wait for the daemon."""
        with self._lock:
            if self.mode is not RealtimeMode.OFF or self._closing:
                return self.mode
        self._ensure_consumer()
        with self._lock:
            self._overflow = False
            self._stop_reason = None
            self._buffer.clear()
            self._buffered_bytes = 0
            self._set_mode(RealtimeMode.TRY_START)  # buffer from now on; records before it are skipped
        ptr, end = self.wal.append_and_roll(TryStartRealtimeCdcRecord(time.time_ns()))
        self.wal.wait_durable(end)
        failpoints.hit("realtime.on.try_start_durable")
        with self._lock:
            self.try_start = ptr
            self._deliver_from = WalPosition(ptr.segment + 1, 0, 0)
            self._cv.notify()
        self._persist(enabled=False)
        failpoints.hit("realtime.on.try_start_persisted")
        log.info("realtime_try_start", try_start=str(ptr), buffer_max_bytes=self.buffer_limit_bytes)
        return RealtimeMode.TRY_START

    def switch(self, state: str) -> str:
        """The control command: ``on`` starts a try-start, ``off`` stops (``stopping`` while a long
        batch, a big lake write, finishes first)."""
        if state == "on":
            return self.request_on().value
        if state == "off":
            mode = self.wait_off(self.request_off(), timeout_s=2.0)
            return "stopping" if mode is not RealtimeMode.OFF else mode.value
        raise AttachError("realtime: state must be 'on' or 'off'")

    def wait_off(self, mode: RealtimeMode, timeout_s: float) -> RealtimeMode:
        """After ``request_off``: give the worker a moment to finish its batch and say OFF."""
        deadline = time.monotonic() + timeout_s
        while mode is not RealtimeMode.OFF and time.monotonic() < deadline:
            time.sleep(0.01)
            mode = self.mode
        return mode

    def request_off(self) -> RealtimeMode:
        """Stop (the in-flight batch finishes first); returns at once."""
        with self._lock:
            if self.mode is not RealtimeMode.OFF:
                self._stop_reason = "command"
                self._cv.notify()
            return self.mode

    # --- the worker thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    return
            except _Stopped:
                continue
            except Exception as exc:  # never die silently: say why, fall back to the daemon
                log.error("realtime_worker_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop("worker_error")

    def _step(self) -> bool:
        """One round of the worker; True when it is done (closing)."""
        with self._lock:
            while not (
                self._buffer
                or self._overflow
                or self._stop_reason
                or self._closing
                or self.mode is RealtimeMode.TRY_START
                or self._restore_until is not None
            ):
                self._cv.wait()
            mode, closing = self.mode, self._closing
        if mode is RealtimeMode.OFF:
            with self._lock:
                self._buffer.clear()
                self._buffered_bytes = 0
                self._stop_reason = None
                self._overflow = False
            return closing
        if self._restore_until is not None:
            self._restore()
        elif self._overflow:
            self._stop("overflow")
        elif self._stop_reason:
            self._stop(self._stop_reason)
        elif mode is RealtimeMode.TRY_START:
            if closing:
                self._stop("close_during_try_start")
                return True
            if self._daemon_passed():
                self._switch_on()
            else:
                time.sleep(_POLL_S)
        elif closing and not self._buffer:
            return True
        else:
            self._deliver_available()
        return False

    def _daemon_passed(self) -> bool:
        """The daemon deleted the link of the TryStart segment: it committed everything before it."""
        ts = self.try_start
        if ts is None:
            return False
        if not self.config.cdc_enabled:
            return True
        if self.wal.last_archived < ts.segment or self.wal.link_skipped(ts.segment):
            return False  # never linked (CDC dir full): the daemon cannot pass it; overflow stops us
        return not segment_path(self.config.cdc_path, ts.segment).exists()

    def _switch_on(self) -> None:
        ts = self.try_start
        assert ts is not None
        with self._lock:
            self.position = WalPosition(ts.segment + 1, 0, 0)
            self.try_start = None
            self._set_mode(RealtimeMode.ON)
        failpoints.hit("realtime.on.before_enabled")
        self._persist(enabled=True)
        failpoints.hit("realtime.on.enabled")
        log.info("realtime_switch", direction="daemon_to_node", position=str(self.position))

    def _restore(self) -> None:
        """Re-read the WAL files from where delivery resumes up to where the flushed chunks begin."""
        start, until = self._deliver_from, self._restore_until
        assert start is not None and until is not None
        records: list[tuple[WalPointer, Record, int]] = []
        total = 0
        resume = start.pointer
        last_ptr: WalPointer | None = None
        while True:
            reader = WalReader([self.config.archive_path, self.config.wal_path], resume, active_segment=until.segment)
            try:
                for ptr, record in reader:
                    if ptr >= until:
                        break
                    if last_ptr is not None and ptr <= last_ptr:
                        continue  # read before the segment moved
                    size = (reader.last_reader.end_offset - ptr.offset) if reader.last_reader else 0
                    total += size
                    if total > self.buffer_limit_bytes:
                        log.warning(
                            "realtime_restore_overflow", read_bytes=total, buffer_max_bytes=self.buffer_limit_bytes
                        )
                        self._restore_until = None
                        self._overflow = True
                        return
                    records.append((ptr, record, size))
                    last_ptr = ptr
                break
            except FileNotFoundError:
                # The flusher archived the segment being read (wal/N.wal -> wal/archive/): read on from there.
                resume = last_ptr if last_ptr is not None else start.pointer
                continue
            except Exception as exc:
                log.error("realtime_restore_failed", error=f"{type(exc).__name__}: {exc}", start=str(start))
                self._restore_until = None
                self._stop("restore_failed")
                return
        self.restored_records = len(records)
        metrics.RT_RESTORED_RECORDS.set(len(records))
        log.info("realtime_restored", records=len(records), bytes=total, last=str(last_ptr) if last_ptr else None)
        with self._lock:
            self._restore_until = None
            self._buffer.appendleft(records)
            self._buffered_bytes += total

    def _records(self) -> Iterator[tuple[WalPointer, Record, int]]:
        """Buffered records in WAL order, from the delivery start; the third value is how many
        entries of the record were already delivered (all of a non-data record: 1)."""
        while True:
            with self._lock:
                if not self._buffer or self._overflow or self._stop_reason:
                    return
                source = self._buffer.popleft()
                size = sum(s for _, _, s in source) if isinstance(source, list) else len(source.data)
                self._buffered_bytes -= size
                metrics.RT_BUFFER_BYTES.set(self._buffered_bytes)
            items = source if isinstance(source, list) else iter_chunk(source.data, source.segment, source.offset)
            start = self._deliver_from
            for ptr, record, _rsize in items:
                done = 0
                if start is not None:
                    done = start.entries_done(ptr, record_entries(record))
                    if ptr < start.pointer:
                        continue
                    self._deliver_from = start = None
                yield ptr, record, done

    def _deliver_available(self) -> None:
        """Deliver everything buffered now, in batches of at most ``realtime_batch_max_events``."""
        batcher = self._batcher
        if batcher is None:
            # A new run of deliveries: a fresh consumer hears of every cache whose CREATE it reads.
            batcher = self._batcher = Batcher(
                position=self.position,
                caches={},
                source_node=self.node_id,
                batch_max_events=self.config.realtime_batch_max_events,
                batch_max_bytes=_NO_BYTE_BOUND,
                names=self._names,
            )
        batcher.restart(self.position)
        for cid, info in self._caches().items():
            self._names[cid] = info.name
            if not info.config.cdc_enabled and cid not in batcher.caches:  # created before what this worker read
                batcher.disabled.add(cid)
        skipped = False
        for ptr, record, done in self._records():
            rtype = type(record)
            if rtype is DataRecord:
                assert isinstance(record, DataRecord)
                if done >= len(record.entries):
                    continue
                before = batcher.events
                batch = batcher.data(ptr, record, done, 0)
                if batch is not None:
                    self._deliver(batch)
                elif batcher.events == before:
                    skipped = True
                continue
            if done:
                continue  # a marker or cache record already handled before the restart
            if rtype is CacheRecord:
                assert isinstance(record, CacheRecord)
                for item in batcher.cache_record(ptr, record):
                    if isinstance(item, Batch):
                        self._deliver(item)
                    else:
                        self._cache_change(item)
            else:
                batcher.passed(ptr, record)
        if batcher.slices:
            self._deliver(batcher.close())
        elif skipped and batcher.position is not None and not self._unconfirmed:
            # Only entries of caches with CDC off: nothing to deliver, the position moves on all the
            # same (only after data: a marker alone would make the next marker, forever).
            self._commit(batcher.position)

    def _cache_change(self, change: CacheChange) -> None:
        consumer = self._ensure_consumer()
        if change.created and not change.quiet:
            consumer.on_cache_change(change.created)
        if change.destroyed:  # the consumer never heard of a cache with CDC off
            consumer.on_cache_destroy(change.destroyed)

    def _deliver(self, item: Batch) -> None:
        consumer = self._ensure_consumer()
        end = item.end
        rest: EventBatch | None = item.events
        while rest is not None:
            # Ignite's loop: what the consumer did not pull goes to its next call, also from
            # inside a record; a True commits the position after what it took.
            batch = rest
            try:
                ok = consumer.on_events(batch)
            except Exception as exc:
                log.error("realtime_consumer_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop("consumer_error", consumer_failed=True)
                raise _Stopped from None
            taken, rest = batch.split_taken()
            took = len(batch) - (len(rest) if rest is not None else 0)
            if took:
                ts = taken[-1].record.commit_ts_ns
                self.last_event_ts_ns = ts
                metrics.RT_LAG_SECONDS.observe(max(0.0, (time.time_ns() - ts) / 1e9))
                metrics.RT_EVENTS.inc(took)
            if ok:
                self._unconfirmed = False
                self._commit(end if rest is None or rest.first is None else rest.first.cursor())
            else:
                self._unconfirmed = True  # not committed yet: the next confirmed call commits both
            if rest is not None and not took:
                # Took nothing: offer it again shortly, unless realtime is stopping (the daemon then
                # delivers from the last commit, which is before these events).
                if self._stop_reason or self._overflow or self.mode is not RealtimeMode.ON:
                    raise _Stopped
                time.sleep(_POLL_S)

    def _commit(self, end: WalPosition) -> None:
        """The consumer confirmed everything before ``end``: make it the position (and on the
        marker cadence have the marker thread persist it and tell the daemon)."""
        with self._meta_lock:
            if self.mode is not RealtimeMode.ON:
                return  # stopped while this batch ran (close timed out): the Stop record already went out
            self.position = end
            interval_s = self.config.realtime_commit_record_interval_ms / 1000
            if time.monotonic() - self._last_marker >= interval_s:
                self._last_marker = time.monotonic()
                self._marker_due.set()
        metrics.RT_COMMITTED_SEGMENT.set(end.segment)
        metrics.RT_COMMITTED_OFFSET.set(end.offset)
        metrics.RT_LAG_SEGMENTS.set(max(0, self.wal.position.segment - end.segment))

    def _run_markers(self) -> None:
        """The marker thread: persist the committed position, then write ``RealtimeCdcRecord`` for it.
        The synced metastorage write cost half the worker's time when done per batch, and on the
        delivery thread every record flushed during it waited: here deliveries go on meanwhile.
        On this cadence a crash re-delivers at most one interval (at-least-once; the lake drops it)."""
        while True:
            self._marker_due.wait()
            self._marker_due.clear()
            if self._closing:
                return  # close() writes the last marker itself
            try:
                self._write_marker()
            except Exception as exc:  # never die silently: say why, fall back to the daemon
                log.error("realtime_marker_failed", error=f"{type(exc).__name__}: {exc}")
                try:
                    self._stop("worker_error")
                except Exception as stop_exc:
                    log.error("realtime_stop_failed", error=f"{type(stop_exc).__name__}: {stop_exc}")
                return

    def _write_marker(self) -> None:
        # Persist first: the marker lets the daemon delete links, so it must never be ahead.
        with self._marker_lock:
            with self._meta_lock:
                if self.mode is not RealtimeMode.ON or self.position is None:
                    return
                state = RealtimeState(True, self.position, self.try_start)
            # Outside ``_meta_lock``: the worker commits further batches during the synced write.
            self.meta.put(state)
            self.state = state
            assert state.position is not None
            self.wal.append(RealtimeCdcRecord(state.position))

    def _persist(self, *, enabled: bool) -> None:
        """Synced LMDB write; never called under ``_lock`` (the flusher must not wait for it)."""
        with self._marker_lock, self._meta_lock:
            self._persist_locked(enabled=enabled)

    def _persist_locked(self, *, enabled: bool) -> None:
        self.state = RealtimeState(enabled, self.position, self.try_start)
        self.meta.put(self.state)

    def _stop(self, reason: str, *, consumer_failed: bool = False) -> None:
        """Stop: persist disabled, write Stop(last), drop the buffer. The daemon delivers from ``last``."""
        with self._lock:
            if self.mode is RealtimeMode.OFF:
                return
            was = self.mode
            if was is RealtimeMode.TRY_START and self.try_start is not None:
                # Never delivered past the TryStart: the daemon goes on from right after it.
                self.position = WalPosition(self.try_start.segment + 1, 0, 0)
            self.try_start = None
            self._buffer.clear()
            self._buffered_bytes = 0
            self._overflow = False
            self._stop_reason = None
            self._deliver_from = None
            self._restore_until = None
            self._batcher = None
            self._unconfirmed = False
            self._set_mode(RealtimeMode.OFF)
            metrics.RT_BUFFER_BYTES.set(0)
        # After this, no delivery still in flight persists or marks anything (a marker being
        # written finishes first: it is for a position before this Stop's).
        with self._marker_lock, self._meta_lock:
            self._persist_locked(enabled=False)
            failpoints.hit("realtime.off.persisted")
            _ptr, end = self.wal.append(StopRealtimeCdcRecord(self.position, reason))
        self.wal.wait_durable(end)
        failpoints.hit("realtime.off.stop_durable")
        if self._closing:
            # The node is going away: roll the segment so the daemon sees the Stop now, not at next start.
            self.wal.force_archive()
        self.stops[reason] = self.stops.get(reason, 0) + 1
        metrics.RT_STOPS.labels(reason).inc()
        log.warning(
            "realtime_switch",
            direction="node_to_daemon",
            reason=reason,
            was=was.value,
            last=str(self.position) if self.position else None,
        )
        if consumer_failed and self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            try:
                consumer.stop()
            except Exception as exc:
                log.error("realtime_consumer_stop_failed", error=f"{type(exc).__name__}: {exc}")

    def _set_mode(self, mode: RealtimeMode) -> None:
        self.mode = mode
        for m in RealtimeMode:
            metrics.RT_MODE.labels(m.value).set(1 if m is mode else 0)

    # --- closing --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain (bounded by ``realtime_close_timeout_ms``) and commit; abort a pending try-start."""
        with self._lock:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(self.config.realtime_close_timeout_ms / 1000)
            if self._thread.is_alive():
                log.error("realtime_close_timeout", buffered_bytes=self._buffered_bytes)
                interrupt = getattr(self._consumer, "interrupt", None)  # e.g. retrying a dead target
                if callable(interrupt):
                    interrupt()
                    self._thread.join(5.0)
                self._stop("close_timeout")
        self._marker_due.set()  # with _closing set: the marker thread ends
        if self._marker_thread is not None:
            self._marker_thread.join()
        end = None
        with self._marker_lock, self._meta_lock:
            if self.mode is RealtimeMode.ON and self.position is not None:
                self._persist_locked(enabled=True)
                _ptr, end = self.wal.append(RealtimeCdcRecord(self.position))
        if end is not None:
            self.wal.wait_durable(end)
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            consumer.stop()

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "buffer_used_bytes": self._buffered_bytes,
            "buffer_max_bytes": self.buffer_limit_bytes,
            "buffer_max_used_bytes": self.buffer_max_used_bytes,
            "committed": str(self.position) if self.position else None,
            "try_start": str(self.try_start) if self.try_start else None,
            "restored_records": self.restored_records,
            "stops": dict(self.stops),
            "last_event_commit_ts_ns": self.last_event_ts_ns,
        }


class _Stopped(Exception):
    """Internal: a consumer failure stopped realtime in the middle of a delivery loop."""
