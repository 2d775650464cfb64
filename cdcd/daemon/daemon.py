"""The cdcd daemon: follows one node's CDC directory and delivers to a consumer (DESIGN §6).

``sync_once()`` processes whatever the CDC dir holds now, synchronously (tests and tools call
it); ``run()`` is the long-running form: a pipeline of bounded asyncio queues
(reader → decoder → consumer) with blocking work on worker threads, woken by file-system events
and a periodic rescan.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import numpy as np
import structlog
from prometheus_client import REGISTRY
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from cdcd import metrics
from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.committer import Committer, ConsumerFailed
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.follower import SegmentFollower, delete_links_below
from cdcd.daemon.processor import Batch, Item, Processor, Switch
from cdcd.daemon.sdnotify import Notifier
from cdcd.daemon_state import DaemonState, ForeignState, Mode, StateStore
from cdcd.lock import DirLock
from cdcd.node.identity import read_node_id
from cdcd.wal.errors import WalError
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import CacheInfo, DataRecord
from cdcd.wal.segment import list_segments

log = structlog.get_logger("cdcd.daemon")
T = TypeVar("T")
_commit_ts = operator.attrgetter("record.commit_ts_ns")
_end = operator.attrgetter("end")
_start = operator.attrgetter("start")

INITIAL_MODE = Mode.PASSIVE
"""A fresh daemon waits for the node to say who delivers (DESIGN §5)."""

_PASSIVE_SKIP = frozenset({DataRecord.TYPE})
_TAIL_PEEK_RECORDS = 64
"""Records read from the head of the node's active segment to find its first data record."""


def fix_mmap_threshold(threshold_bytes: int = 128 * 1024) -> None:
    """For a process that runs the daemon (``cdcd run``): keep glibc from moving its mmap threshold
    up after the reader frees a 1 MiB buffer: the buffers would then come from the heap and fragment
    it, and RSS would grow with the backlog. Process-wide, so the library never calls it itself."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-3, threshold_bytes)  # M_MMAP_THRESHOLD; setting it also disables the sliding threshold
    except (OSError, AttributeError):
        return  # not glibc: nothing to tune


class PipelineStalled(Exception):
    """A consumer call or segment read ran past ``consumer_stall_timeout_ms``: the daemon exits (code 6)."""


def daemon_lock(config: DaemonConfig) -> DirLock:
    """One daemon per node: the lock lives in the node dir."""
    return DirLock(Path(config.node_dir) / "cdcd.lock")


class _Wake(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        self._loop = loop
        self._event = event

    def on_any_event(self, event: FileSystemEvent) -> None:
        # The observer thread may still see an event after a failed pass closed the loop: nothing
        # is left to wake then.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._event.set)


class Daemon:
    """Use ``start()``/``stop()`` or ``async with``; ``stop()`` is idempotent."""

    def __init__(self, config: DaemonConfig, consumer: Consumer, *, show_progress: bool = False) -> None:
        """``show_progress``: a catch-up bar on stdout (``cdcd run`` on a terminal; a library prints nothing there)."""
        self.config = config
        self.consumer = consumer
        self.cdc_dir = config.cdc_path
        self._lock = daemon_lock(config)
        self._store: StateStore | None = None
        self._committer: Committer | None = None
        self._started = False
        self._consumer_started = False
        self._stopping = threading.Event()
        self._notifier = Notifier()
        self._show_progress = show_progress
        self._progress_total: int | None = None
        self._progress_start = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        # Liveness, read by the monitor task and at scrape time (plain attributes: no lock needed).
        self._busy: dict[str, tuple[str, float]] = {}
        """Worker-thread call in flight per pipeline stage: (what, monotonic start)."""
        self._oldest_unconfirmed_ns: int | None = None
        self._tail: tuple[int, int] | None = None
        """(segment, commit ns) of the first data record in the node's active segment, not yet in a link."""
        self._segment_started: dict[int, float] = {}
        self._stalled: str | None = None
        self.node_id: uuid.UUID | None = None
        """The node whose segments are delivered: from the node dir, else the first segment read."""
        self._follower: SegmentFollower | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the lock, load the state, delete links below it, start the consumer."""
        if self._started:
            return
        # Before the lock: a wrong node_dir must not leave a lock file (or a dir) behind.
        if not Path(self.config.node_dir).is_dir():
            raise FileNotFoundError(f"node_dir {self.config.node_dir} does not exist")
        if not self.cdc_dir.is_dir():
            raise FileNotFoundError(f"cdc_dir {self.cdc_dir} does not exist (is node_dir right?)")
        self._lock.acquire(self.config.lock_timeout_ms)
        metrics.export(metrics.DAEMON)
        metrics.DAEMON_LAG_SECONDS.set_function(self._lag_seconds)
        metrics.DAEMON_SEGMENTS_PENDING.set_function(self._segments_pending)
        try:
            self.node_id = read_node_id(self.config.node_dir)
            self._store = StateStore(self.config.state_path)
            state = self._store.load(INITIAL_MODE)
            caches = self._store.caches()
            if not self._store.has_state():
                state = self._initial_state(state)
                if not caches:
                    from cdcd.daemon.source import node_caches

                    caches, caches_from = node_caches(self.config.node())
                    self._store.commit(state, caches=caches)  # the registry stays with the state
                    state = self._store.load(INITIAL_MODE)
                    log.info("cache_registry_from_node", caches=len(caches), source=caches_from)
            state = self._check_owner(state)
            if state.position is not None:
                for seg in delete_links_below(self.cdc_dir, state.position.segment):
                    log.info("stale_link_deleted", segment=seg)
            try:
                self.consumer.start(REGISTRY)
                self._consumer_started = True
                announced = [info for info in caches.values() if info.config.cdc_enabled]
                if announced:
                    self.consumer.on_cache_change(announced)
            except Exception as exc:
                raise ConsumerFailed(f"consumer start() raised {type(exc).__name__}: {exc}") from exc
            self._committer = Committer(
                self._store, state, caches, self.consumer, self.cdc_dir, stopping=self._stopping
            )
            self._started = True
            log.info(
                "daemon_started",
                node_dir=self.config.node_dir,
                cdc_dir=str(self.cdc_dir),
                state_dir=str(self.config.state_path),
                node_id=str(self.node_id) if self.node_id else None,
                mode=state.mode.value,
                position=str(state.position) if state.position else None,
                consumer=type(self.consumer).__name__,
            )
        except BaseException:
            self._shutdown()
            raise

    def _initial_state(self, state: DaemonState) -> DaemonState:
        """No state (new, deleted or emptied): ask the node who delivers rather than wait PASSIVE for a Stop
        record that a running node writes only when it opens. Its realtime worker delivers: PASSIVE. It does
        not: ACTIVE from where its realtime worker stopped, or the oldest link."""
        from cdcd.daemon.source import ask_node

        node = ask_node(self.config.node())
        if node is None:
            log.warning(
                "daemon_without_state_waits",
                node_dir=self.config.node_dir,
                hint="the node neither answers on its control socket nor has a metastorage; "
                "PASSIVE until it writes a Stop record (at its next start)",
            )
            return state
        if node.realtime_on:
            mode, position = Mode.PASSIVE, None
        else:
            links = self._follower_scan()
            position = node.position
            if position is not None and links and position.segment < min(links):
                position = None  # consumed and unlinked: the oldest link is where delivery goes on
            mode = Mode.ACTIVE
        log.info(
            "daemon_state_from_node",
            source=node.source,
            mode=mode.value,
            position=str(position) if position else None,
            start="the oldest link" if position is None and mode is Mode.ACTIVE else None,
        )
        return msgspec.structs.replace(state, mode=mode, position=position)

    def _follower_scan(self) -> dict[int, Path]:
        return SegmentFollower(self.cdc_dir, None).scan()

    def _check_owner(self, state: DaemonState) -> DaemonState:
        """A state of another node is an error before anything acts on it (its position would delete this
        node's links); a state that does not say whose it is yet gets this node's id."""
        assert self._store is not None
        if state.node_id and self.node_id is not None and state.node_id != str(self.node_id):
            raise ForeignState(
                f"{self._store.data_file}: daemon state of node {state.node_id}, but {self.config.node_dir} is node "
                f"{self.node_id} (node dir re-created, or state_dir of another node?); stop the daemon and run "
                "`cdcd state reset`"
            )
        if state.node_id and self.node_id is None:
            self.node_id = uuid.UUID(state.node_id)
        if self.node_id is not None and (not state.node_id or not self._store.has_state()):
            state = self._store.commit(msgspec.structs.replace(state, node_id=str(self.node_id)))
        return state

    def stop(self) -> None:
        """Ask a running ``run()`` to finish its in-flight batch and return (thread- and signal-safe)."""
        self._stopping.set()
        interrupt = getattr(self.consumer, "interrupt", None)  # user classes may not subclass Consumer
        if callable(interrupt):
            interrupt()
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        self._stopping.set()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._stalled is not None:
            # A worker thread is still inside the consumer or the state store: leave both to the
            # process exit (the state is durable up to the last commit; the lock dies with us).
            return
        if self._consumer_started:
            self._consumer_started = False
            self.consumer.stop()
        if self._store is not None:
            self._store.close()
            self._store = None
        self._lock.release()
        if self._started:
            self._started = False
            log.info("daemon_stopped", node_dir=self.config.node_dir)

    async def __aenter__(self) -> Daemon:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def state(self) -> DaemonState:
        assert self._committer is not None, "daemon not started"
        return self._committer.state

    @property
    def events_delivered(self) -> int:
        return self._committer.events_delivered if self._committer else 0

    # --- one pass, synchronously -----------------------------------------------------------------
    def _new_pass(self) -> tuple[Processor, SegmentFollower]:
        committer = self._committer
        assert committer is not None, "daemon not started"
        state = committer.state
        processor = Processor(
            mode=state.mode,
            position=state.position,
            caches=dict(committer.caches),
            source_node="",
            batch_max_events=self.config.batch_max_events,
            batch_max_bytes=self.config.batch_max_bytes,
        )
        skip = _PASSIVE_SKIP if state.mode is Mode.PASSIVE else frozenset()
        if self.node_id is None and self._follower is not None:
            self.node_id = self._follower.expect_node_id  # learnt from the first segment read
            if self.node_id is not None and not state.node_id:
                committer.state = state = msgspec.structs.replace(state, node_id=str(self.node_id))
        self._follower = SegmentFollower(self.cdc_dir, state.position, skip_types=skip, expect_node_id=self.node_id)
        return processor, self._follower

    def sync_once(self) -> int:
        """Process everything the CDC dir holds now (across mode switches); returns events delivered."""
        committer = self._committer
        assert committer is not None, "daemon not started"
        before = committer.events_delivered
        processor, follower = self._new_pass()
        while True:
            try:
                chunk = follower.read(self.config.read_chunk_records)
            except WalError:
                if processor.pending_events or _advanced(processor, committer):
                    committer.apply(processor.close_batch())  # deliver what came before the bad spot
                raise
            if chunk is None:
                if processor.pending_events or _advanced(processor, committer):
                    committer.apply(processor.close_batch())
                return committer.events_delivered - before
            processor.source_node = follower.node_id
            for item in processor.feed_many(chunk):
                committer.apply(item)
            if processor.finished:
                processor, follower = self._new_pass()

    # --- the long-running form -------------------------------------------------------------------
    async def run(self) -> None:
        """Run until ``stop()``; raises on anything unexpected (the caller exits non-zero)."""
        if not self._started:
            await asyncio.to_thread(self.start)
        loop = asyncio.get_running_loop()
        self._loop, self._stop_event = loop, asyncio.Event()
        if self._stopping.is_set():
            self._stop_event.set()
        wake = asyncio.Event()
        observer = Observer()
        observer.schedule(_Wake(loop, wake), str(self.cdc_dir), recursive=False)
        observer.start()
        self._notifier.ready(f"following {self.cdc_dir}")

        async def passes() -> None:
            while not self._stopping.is_set():
                await self._run_pass(wake)

        passes_task = asyncio.create_task(passes(), name="cdcd-passes")
        monitor_task = asyncio.create_task(self._monitor(), name="cdcd-monitor")
        try:
            # The monitor ends only by raising PipelineStalled; the passes end on stop() or an error.
            await asyncio.wait({passes_task, monitor_task}, return_when=asyncio.FIRST_COMPLETED)
            if monitor_task.done():
                monitor_task.result()
            passes_task.result()
        finally:
            self._notifier.stopping()
            for task in (monitor_task, passes_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            observer.stop()
            await asyncio.to_thread(observer.join)
            if self._show_progress and self._progress_total:
                print(file=sys.stdout)

    async def _monitor(self) -> None:
        """WATCHDOG=1 pings while the pipeline makes progress; PipelineStalled once a worker-thread
        call (consumer or segment read) has run longer than ``consumer_stall_timeout_ms``."""
        interval = self._notifier.watchdog_interval_s
        limit_s = self.config.consumer_stall_timeout_ms / 1000
        tick = min(1.0, limit_s / 10, interval or 1.0)
        next_ping = 0.0
        while True:
            now = time.monotonic()
            for stage, (what, since) in list(self._busy.items()):
                if now - since > limit_s:
                    self._stalled = (
                        f"pipeline stalled: {what} has not returned for {now - since:.1f} s "
                        f"(consumer_stall_timeout_ms = {self.config.consumer_stall_timeout_ms}, {stage}); "
                        f"{self._segments_pending()} segment link(s) pending"
                    )
                    raise PipelineStalled(self._stalled)  # no more pings: systemd's watchdog agrees
            if interval is not None and now >= next_ping:
                self._notifier.watchdog()
                next_ping = now + interval
            await asyncio.sleep(tick)

    async def _in_thread(self, stage: str, what: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread, watched by the monitor for stalls."""
        self._busy[stage] = (what, time.monotonic())
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self._busy.pop(stage, None)

    def _check_alive(self) -> None:
        try:
            ok = self.consumer.alive()
        except Exception as exc:
            raise ConsumerFailed(f"consumer alive() raised {type(exc).__name__}: {exc}") from exc
        if not ok:
            raise ConsumerFailed("consumer reports alive() == False")

    async def _run_pass(self, wake: asyncio.Event) -> None:
        """One pass in one mode, until a mode switch or stop()."""
        processor, follower = self._new_pass()
        committer = self._committer
        assert committer is not None
        config = self.config
        read_q: asyncio.Queue[list[tuple[object, object, int]] | None] = asyncio.Queue(config.queue_max_batches)
        item_q: asyncio.Queue[Item] = asyncio.Queue(config.queue_max_batches)
        check_s = config.check_interval_ms / 1000
        delay_s = config.batch_max_delay_ms / 1000
        stopping = self._stop_event
        assert stopping is not None

        async def reader() -> None:
            while True:
                try:
                    chunk = await self._in_thread(
                        "reader", f"reading segment {follower.segment}", follower.read, config.read_chunk_records
                    )
                except WalError as exc:
                    # After everything read before it: the good data is delivered and committed first.
                    await read_q.put(exc)  # type: ignore[arg-type]
                    return
                if follower.segment is not None:
                    metrics.DAEMON_CURRENT_SEGMENT.set(follower.segment)
                if chunk:  # one read may span segments
                    now = time.monotonic()
                    for segment in range(chunk[0][0].segment, chunk[-1][0].segment + 1):
                        self._segment_started.setdefault(segment, now)
                if chunk is None:
                    await read_q.put(None)  # caught up: the decoder closes its batch now
                    if processor.mode is Mode.ACTIVE:
                        self._tail = await asyncio.to_thread(self._peek_active_segment, follower)
                    wake.clear()
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                    # races with the wake-up, and stop() would then hang on a full queue.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(check_s):
                            await wake.wait()
                    continue
                await read_q.put(chunk)  # type: ignore[arg-type]

        async def decoder() -> None:
            while True:
                timeout = None
                if processor.batch_started is not None:
                    timeout = max(0.0, processor.batch_started + delay_s - time.monotonic())
                timed_out = False
                try:
                    async with asyncio.timeout(timeout):
                        chunk = await read_q.get()
                except TimeoutError:
                    chunk, timed_out = None, True
                if isinstance(chunk, WalError):
                    if processor.pending_events or _advanced(processor, committer):
                        await item_q.put(processor.close_batch())
                    await item_q.put(chunk)  # type: ignore[arg-type]
                    return
                if chunk is None:
                    # Caught up (segments arrive whole, waiting adds only lag) or batch_max_delay_ms passed.
                    if processor.pending_events or (not timed_out and _advanced(processor, committer)):
                        await item_q.put(processor.close_batch())  # or position-only progress (segment ends)
                    continue
                processor.source_node = follower.node_id
                for item in processor.feed_many(chunk):  # type: ignore[arg-type]
                    await item_q.put(item)
                if processor.finished:
                    return

        async def consumer() -> None:
            get: asyncio.Future[Any] | None = None
            while True:
                if get is None:
                    get = asyncio.ensure_future(item_q.get())
                stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
                done, _ = await asyncio.wait({get, stop_wait}, timeout=check_s, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                if stop_wait in done:
                    get.cancel()
                    return
                if get not in done:
                    # Idle: ask the consumer on every poll whether it can still take events (Ignite
                    # IGNITE-18249), so a dead sink ends the daemon even when nothing is written.
                    await asyncio.shield(self._in_thread("consumer", "consumer alive()", self._check_alive))
                    continue
                item, get = get.result(), None
                if isinstance(item, WalError):
                    raise item
                what = type(item).__name__
                if isinstance(item, Batch) and len(item.events):
                    events = item.events
                    what = f"consumer on_events() with {len(events)} events from {events.first}"
                    if self._oldest_unconfirmed_ns is None:
                        self._oldest_unconfirmed_ns = events.peek_slices()[0].record.commit_ts_ns
                    _observe_capture(events)
                # Shielded: a started batch finishes (and commits if confirmed) even on shutdown.
                await asyncio.shield(self._in_thread("consumer", what, committer.apply, item))
                if not committer.unconfirmed:
                    self._oldest_unconfirmed_ns = None
                self._segments_done(committer)
                self._show(follower)
                if isinstance(item, Switch) or self._stopping.is_set():
                    return

        tasks = [
            asyncio.create_task(reader(), name="cdcd-reader"),
            asyncio.create_task(decoder(), name="cdcd-decoder"),
        ]
        consumer_task = asyncio.create_task(consumer(), name="cdcd-consumer")
        try:
            # The consumer task ends the pass (switch or stop); a failure anywhere ends it too.
            pending: set[asyncio.Task[None]] = {*tasks, consumer_task}
            while consumer_task in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not consumer_task and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            consumer_task.result()
        finally:
            for t in (*tasks, consumer_task):
                t.cancel()
            for t in (*tasks, consumer_task):
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    # --- progress ----------------------------------------------------------------------------------
    def _segments_pending(self) -> int:
        """Links not yet wholly consumed: from the committed position's segment on (at scrape time)."""
        if self._committer is None or not self._started:
            return 0
        pos = self._committer.state.position
        found, _ = list_segments(self.cdc_dir)
        return sum(1 for s in found if pos is None or s >= pos.segment)

    def _lag_seconds(self) -> float:
        """now - commit time of the oldest entry not yet confirmed: in a batch the consumer has not
        confirmed, or in the node's active segment (waiting for its roll). 0 in PASSIVE mode (the
        node's realtime worker delivers; its lag is on the node's endpoint)."""
        committer = self._committer
        if committer is None or not self._started or committer.state.mode is Mode.PASSIVE:
            return 0.0
        oldest = [ts for ts in (self._oldest_unconfirmed_ns,) if ts is not None]
        tail, pos = self._tail, committer.state.position
        if tail is not None and (pos is None or tail[0] >= pos.segment):
            oldest.append(tail[1])
        return max(0.0, time.time() - min(oldest) / 1e9) if oldest else 0.0

    def _peek_active_segment(self, follower: SegmentFollower) -> tuple[int, int] | None:
        """The first data record of the node's active segment (``<node_dir>/wal``), if it is newer
        than every link: written, not yet archived, so not yet visible to the daemon."""
        work = Path(self.config.node_dir) / "wal"
        try:
            found, _ = list_segments(work)
        except OSError:
            return None
        links = follower.scan()
        if not found or (links and max(found) <= max(links)):
            return None
        segment = max(found)
        try:
            for n, (_ptr, record) in enumerate(SegmentReader(found[segment], archived=False)):
                if isinstance(record, DataRecord):
                    return segment, record.commit_ts_ns
                if n >= _TAIL_PEEK_RECORDS:
                    break
        except (OSError, WalError):
            return None  # rolled away meanwhile, or being written: the next poll looks again
        return None

    def _segments_done(self, committer: Committer) -> None:
        pos = committer.state.position
        if pos is None:
            return
        now = time.monotonic()
        for segment in [s for s in self._segment_started if s < pos.segment]:
            metrics.DAEMON_SEGMENT_CONSUMING_SECONDS.observe(now - self._segment_started.pop(segment))

    def _show(self, follower: SegmentFollower) -> None:
        if not self._show_progress or self._committer is None:
            return
        pos = self._committer.state.position
        if pos is None:
            return
        if self._progress_total is None:
            found = follower.scan()
            if not found or max(found) - pos.segment <= 1:
                return
            self._progress_start = pos.segment
            self._progress_total = max(found) + 1 - pos.segment
        done = min(self._progress_total, pos.segment - self._progress_start)
        width = 30
        filled = int(width * done / self._progress_total)
        bar = "#" * filled + "." * (width - filled)
        sys.stdout.write(f"\rcatching up [{bar}] {done}/{self._progress_total} segments")
        sys.stdout.flush()


def _observe_capture(events: EventBatch) -> None:
    """Per event: commit time to now, weighted by entries per record (one numpy pass per batch)."""
    slices = events.peek_slices()
    n = len(slices)
    # map + attrgetter keep the per-record work in C (this runs for every batch).
    ts = np.fromiter(map(_commit_ts, slices), np.int64, n)
    weights = np.fromiter(map(_end, slices), np.float64, n)
    weights -= np.fromiter(map(_start, slices), np.float64, n)
    ages = np.maximum((time.time_ns() - ts) / 1e9, 0.0)
    metrics.DAEMON_EVENT_CAPTURE_SECONDS.observe_many(ages, weights)


def _advanced(processor: Processor, committer: Committer) -> bool:
    """ACTIVE only: the read position moved past the committed one without events (markers, segment ends).

    In PASSIVE the position is the node's, learnt from its markers, never the read position.
    """
    return processor.mode is Mode.ACTIVE and processor.position != committer.state.position


__all__ = ["CacheInfo", "Daemon", "PipelineStalled", "daemon_lock"]
