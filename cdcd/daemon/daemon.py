"""The cdcd daemon: follows one node's CDC directory and delivers to a consumer (DESIGN §6).

``sync_once()`` processes whatever the CDC dir holds now, synchronously (tests and tools call
it); ``run()`` is the long-running form: a pipeline of bounded asyncio queues
(reader → decoder → consumer) with blocking work on worker threads, woken by file-system events
and a periodic rescan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import structlog
from prometheus_client import REGISTRY
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from cdcd import metrics
from cdcd.config import CacheFilter
from cdcd.consumer import Consumer
from cdcd.daemon.committer import Committer, ConsumerFailed
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.follower import ReadItem, SegmentFollower, delete_links_below
from cdcd.daemon.processor import Batch, Item, Processor, Switch
from cdcd.daemon.rewind import rewind
from cdcd.daemon.sdnotify import Notifier
from cdcd.daemon.start_state import load_start_state
from cdcd.daemon.watch import PipelineStalled, Watch
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.lock import DirLock
from cdcd.logging import describe
from cdcd.node.identity import read_node_id
from cdcd.version import version_and_commit
from cdcd.wal.errors import WalError
from cdcd.wal.records import CacheInfo, DataRecord

log = structlog.get_logger("cdcd.daemon")
T = TypeVar("T")
_commit_ts = operator.attrgetter("record.commit_ts_ns")
_end = operator.attrgetter("end")
_start = operator.attrgetter("start")

_PASSIVE_SKIP = frozenset({DataRecord.TYPE})


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
        """``show_progress``: catch-up progress log lines (``cdcd run`` on a terminal; a library logs none)."""
        self.config = config
        self.consumer = consumer
        self.selected = CacheFilter.from_table(config.consumer, "consumer")
        """The consumer table's ``caches``/``exclude_caches``: applied by the batcher, so a cache left
        out is neither delivered, counted nor announced."""
        self.cdc_dir = config.cdc_path
        self._lock = daemon_lock(config)
        self._store: StateStore | None = None
        self._committer: Committer | None = None
        self._started = False
        self._consumer_started = False
        self._stopping = threading.Event()
        self._notifier = Notifier()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._watch = Watch(config, self._notifier, self._committed_state, show_progress=show_progress)
        self.node_id: uuid.UUID | None = None
        """The node whose segments are delivered: from the node dir, else the first segment read."""
        self._follower: SegmentFollower | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self, *, locked: Callable[[], None] | None = None) -> None:
        """Take the lock, load the state, delete links below it, start the consumer. ``locked()`` runs
        once the lock is held, before anything that may wait on the target (the consumer's start, its
        cache calls retried through an outage): the entry point serves the metrics there."""
        if self._started:
            return
        # Before the lock: a wrong node_dir must not leave a lock file (or a dir) behind.
        if not Path(self.config.node_dir).is_dir():
            raise FileNotFoundError(f"node_dir {self.config.node_dir} does not exist")
        if not self.cdc_dir.is_dir():
            raise FileNotFoundError(f"cdc_dir {self.cdc_dir} does not exist (is node_dir right?)")
        self._lock.acquire(self.config.lock_timeout_ms)
        metrics.export(metrics.DAEMON)
        metrics.DAEMON_LAG_SECONDS.set_function(self._watch.lag_seconds)
        metrics.DAEMON_SEGMENTS_PENDING.set_function(self._watch.segments_pending)
        try:
            if locked is not None:
                locked()
            self.node_id = read_node_id(self.config.node_dir)
            self._store = StateStore(self.config.state_path)
            state, caches, self.node_id = load_start_state(self.config, self._store, self.node_id)
            try:
                self.consumer.start(REGISTRY)
                self._consumer_started = True
            except Exception as exc:
                raise ConsumerFailed(f"consumer start() raised {describe(exc)}") from exc
            # Before links are deleted: a target behind the position is re-delivered from them.
            state = self._rewind(state)
            if state.position is not None:
                for seg in delete_links_below(self.cdc_dir, state.position.segment):
                    log.info("stale_link_deleted", segment=seg)
            retrying = functools.partial(self._watch.touch, "consumer")  # a retry step is not a stall
            self._committer = Committer(
                self._store,
                state,
                caches,
                self.consumer,
                self.cdc_dir,
                stopping=self._stopping,
                retrying=retrying,
                rewind=self._rewind,
            )
            self._committer.announce([i for i in caches.values() if i.config.cdc_enabled and self.selected(i.name)])
            self._started = True
            log.info(
                "daemon_started",
                node_dir=self.config.node_dir,
                cdc_dir=str(self.cdc_dir),
                state_dir=str(self.config.state_path),
                node_id=str(self.node_id) if self.node_id else None,
                mode=state.mode.value,
                cdc_mode=state.mode.name,
                position=str(state.position) if state.position else None,
                consumer=type(self.consumer).__name__,
                version=version_and_commit(),
            )
        except BaseException:
            self._shutdown()
            raise

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
        if self._watch.stalled is not None:
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

    def _committed_state(self) -> DaemonState | None:
        return self._committer.state if self._committer is not None and self._started else None

    @property
    def state(self) -> DaemonState:
        assert self._committer is not None, "daemon not started"
        return self._committer.state

    @property
    def events_delivered(self) -> int:
        return self._committer.events_delivered if self._committer else 0

    def _rewind(self, state: DaemonState) -> DaemonState:
        """At start and at a switch to ACTIVE: back to where the consumer's target stops holding what was
        delivered (``daemon/rewind.py``)."""
        assert self._store is not None
        return rewind(self.config, self._store, state, self.consumer, str(self.node_id) if self.node_id else "")

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
            selected=None if self.selected.everything else self.selected,
        )
        skip = _PASSIVE_SKIP if state.mode is CdcMode.NODE_ACTIVE else frozenset()
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
            chunk = _read(follower, self.config.read_chunk_records)
            if chunk is None or isinstance(chunk, WalError):
                for item in end_of_read(processor, committer, chunk):
                    if isinstance(item, WalError):
                        raise item
                    committer.apply(item)
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
        monitor_task = asyncio.create_task(self._watch.monitor(), name="cdcd-monitor")
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
            self._watch.end_progress()

    def _check_alive(self) -> None:
        assert self._committer is not None
        self._committer.check_alive()

    async def _run_pass(self, wake: asyncio.Event) -> None:
        """One pass in one mode, until a mode switch or stop()."""
        processor, follower = self._new_pass()
        committer = self._committer
        assert committer is not None
        config = self.config
        read_q: asyncio.Queue[list[ReadItem] | WalError | None] = asyncio.Queue(config.queue_max_batches)
        item_q: asyncio.Queue[Item | WalError] = asyncio.Queue(config.queue_max_batches)
        check_s = config.check_interval_ms / 1000
        delay_s = config.batch_max_delay_ms / 1000
        stopping = self._stop_event
        assert stopping is not None

        async def reader() -> None:
            while True:
                chunk = await self._watch.in_thread(
                    "reader", f"reading segment {follower.segment}", _read, follower, config.read_chunk_records
                )
                if isinstance(chunk, WalError):
                    await read_q.put(chunk)  # the decoder delivers what came before it, then the consumer raises it
                    return
                if follower.segment is not None:
                    metrics.DAEMON_CURRENT_SEGMENT.set(follower.segment)
                if chunk:
                    self._watch.read(chunk[0][0].segment, chunk[-1][0].segment)
                if chunk is None:
                    await read_q.put(None)  # caught up: the decoder closes its batch now
                    if processor.mode is CdcMode.DAEMON_ACTIVE:
                        await asyncio.to_thread(self._watch.peek_active_segment, follower)
                    wake.clear()
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                    # races with the wake-up, and stop() would then hang on a full queue.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(check_s):
                            await wake.wait()
                    continue
                await read_q.put(chunk)

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
                if chunk is None or isinstance(chunk, WalError):
                    # Caught up (segments arrive whole, waiting adds only lag), batch_max_delay_ms
                    # passed, or a bad spot.
                    for item in end_of_read(processor, committer, chunk, timed_out=timed_out):
                        await item_q.put(item)
                    if chunk is None:
                        continue
                    return
                processor.source_node = follower.node_id
                for item in processor.feed_many(chunk):
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
                    await asyncio.shield(self._watch.in_thread("consumer", "consumer alive()", self._check_alive))
                    continue
                item, get = get.result(), None
                if isinstance(item, WalError):
                    raise item
                what = type(item).__name__
                if isinstance(item, Batch) and len(item.events):
                    events = item.events
                    what = f"consumer on_events() with {len(events)} events from {events.first}"
                    self._watch.batch_started(events)
                # Shielded: a started batch finishes (and commits if confirmed) even on shutdown.
                await asyncio.shield(self._watch.in_thread("consumer", what, committer.apply, item))
                self._watch.committed(committer.state.position, unconfirmed=committer.unconfirmed, follower=follower)
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


def _read(follower: SegmentFollower, records: int) -> list[ReadItem] | WalError | None:
    """The next chunk, None when caught up, or the error of a bad spot (raised after what came before it)."""
    try:
        return follower.read(records)
    except WalError as exc:
        return exc


def end_of_read(
    processor: Processor, committer: Committer, end: WalError | None, *, timed_out: bool = False
) -> list[Item | WalError]:
    """What to carry out when reading stops: caught up (``end`` None) or at a bad spot (``end`` the
    error). Either way what came before is delivered and committed first: the open batch, or the
    read position moved past the committed one without events (ACTIVE only: markers, segment
    ends; not when only ``batch_max_delay_ms`` passed). Then the error, if any, which the caller raises.

    In PASSIVE the position is the node's, learnt from its markers, never the read position."""
    out: list[Item | WalError] = []
    advanced = processor.mode is CdcMode.DAEMON_ACTIVE and processor.position != committer.state.position
    if processor.pending_events or (advanced and not timed_out):
        out.append(processor.close_batch())
    if end is not None:
        out.append(end)
    return out


__all__ = ["CacheInfo", "Daemon", "PipelineStalled", "daemon_lock"]
