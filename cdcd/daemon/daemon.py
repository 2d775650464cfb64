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
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from cdcd import metrics
from cdcd.consumer import Consumer
from cdcd.daemon.config import DEFAULT_CONSUMER, DaemonConfig, consumer_identity
from cdcd.daemon.follower import SegmentFollower, SharedReads, delete_links_below
from cdcd.daemon.lane import Lane, end_of_read, failure_line
from cdcd.daemon.sdnotify import Notifier
from cdcd.daemon.watch import PipelineStalled
from cdcd.daemon_state import DaemonState, StateRefused
from cdcd.faults import Fault
from cdcd.lock import DirLock
from cdcd.node.identity import read_node_id
from cdcd.version import version_and_commit
from cdcd.wal.records import CacheInfo
from cdcd.wal.segment import list_segments

log = structlog.get_logger("cdcd.daemon")


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
    def __init__(self, loop: asyncio.AbstractEventLoop, events: list[asyncio.Event]) -> None:
        self._loop = loop
        self._events = events

    def on_any_event(self, event: FileSystemEvent) -> None:
        # The observer thread may still see an event after a failed pass closed the loop: nothing
        # is left to wake then.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for event in self._events:
            event.set()


class ConsumerStopped(Fault, Exception):
    """A consumer of a daemon of several stopped for good; its exit code is its failure's."""

    def __init__(self, name: str, exc: BaseException) -> None:
        code, line = failure_line(exc)
        super().__init__(f"consumer {name}: {line}")
        self.exit_code = code
        self.name = name


def consumer_state(lane: Lane) -> str:
    """One of ``metrics.CONSUMER_STATES`` for ``lane``, as ``cdcd_daemon_consumer_state`` exports it."""
    if lane.invalidated:
        return "invalidated"
    if lane.failure is not None:
        return "stopped"
    if lane.watch.retrying is not None:
        return "retrying"
    return "delivering"


class Daemon:
    """Use ``start()``/``stop()`` or ``async with``; ``stop()`` is idempotent.

    ``consumer``: the one consumer of a ``[consumer]`` config (named ``default``), or every consumer
    by name (``config.named_consumers()``'s names) for a daemon of several (issue 45)."""

    def __init__(
        self, config: DaemonConfig, consumer: Consumer | Mapping[str, Consumer], *, show_progress: bool = False
    ) -> None:
        """``show_progress``: catch-up progress log lines (``cdcd run`` on a terminal; a library logs none)."""
        self.config = config
        consumers = dict(consumer) if isinstance(consumer, Mapping) else {DEFAULT_CONSUMER: consumer}
        tables = config.named_consumers()
        if isinstance(consumer, Mapping) and set(consumers) != set(tables):
            raise ValueError(f"consumers {sorted(consumers)} do not match the config's {sorted(tables)}")
        self.cdc_dir = config.cdc_path
        self._lock = daemon_lock(config)
        self._started = False
        self._stopping = threading.Event()
        self._notifier = Notifier()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._links_lock = threading.Lock()
        several = len(consumers) > 1
        self.shared = SharedReads(config.shared_read_bytes) if several else None
        """Decoded chunks shared between the consumers (None with one consumer: nothing to share)."""
        handover = config.handover_consumer if several else next(iter(consumers))
        names = [n for n in tables if n in consumers] or list(consumers)
        self.lanes: dict[str, Lane] = {}
        for i, name in enumerate(names):
            self.lanes[name] = Lane(
                config,
                name,
                consumers[name],
                identity=consumer_identity(tables.get(name, {})) if tables.get(name) else "",
                markers=name == handover,
                primary=i == 0,
                notifier=self._notifier,
                stopping=threading.Event(),
                shared=self.shared,
                release=functools.partial(self._release, name),
                show_progress=show_progress,
                others_live=functools.partial(self._others_live, name),
            )
        # One form of record for all: a daemon of several consumers reads each chunk once, for all of them.
        lazy = not any(lane.consumer.decodes_entries for lane in self.lanes.values())
        for lane in self.lanes.values():
            lane.lazy_entries = lazy
        self._primary = self.lanes[names[0]]
        self.consumer = self._primary.consumer
        self.selected = self._primary.selected
        self._watch = self._primary.watch
        self.node_id: uuid.UUID | None = None
        """The node whose segments are delivered: from the node dir, else the first segment read."""

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self, *, locked: Callable[[], None] | None = None) -> None:
        """Take the lock, load the states, delete links below them, start the consumers. ``locked()`` runs
        once the lock is held, before anything that may wait on a target (a consumer's start, its
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
            for lane in self.lanes.values():  # every state checked before any consumer starts
                self.node_id = lane.load(self.node_id) or self.node_id
            for name, lane in self.lanes.items():
                metrics.watch_consumer(
                    name,
                    functools.partial(consumer_state, lane),
                    functools.partial(self._retained_bytes, lane),
                    lane.policy.max_retained_bytes,
                )
            for lane in self.lanes.values():
                lane.node_id = self.node_id
                if lane.failure is not None:
                    continue  # invalidated before: it stays stopped until `cdcd state reset --consumer`
                try:
                    lane.start()
                except Exception as exc:
                    if len(self.lanes) == 1 or isinstance(exc, StateRefused):
                        raise
                    lane.stopped_for_good(exc)  # the others start all the same
            if self.lanes and all(lane.failure is not None for lane in self.lanes.values()):
                raise ConsumerStopped(*next(iter(self.failures.items())))
            # Links below every consumer's position are no consumer's any more.
            self._check_caps()
            low = self._lowest()
            if low is not None:
                for seg in delete_links_below(self.cdc_dir, low):
                    log.info("stale_link_deleted", segment=seg)
            self._started = True
            state = self._primary.committed_state() or self._primary.start_state  # None: it was invalidated
            log.info(
                "daemon_started",
                node_dir=self.config.node_dir,
                cdc_dir=str(self.cdc_dir),
                state_dir=str(self.config.state_path),
                node_id=str(self.node_id) if self.node_id else None,
                mode=state.mode.value if state else None,
                cdc_mode=state.mode.name if state else None,
                position=str(state.position) if state and state.position else None,
                consumer=type(self.consumer).__name__,
                version=version_and_commit(),
                **self._consumers_field(),
            )
        except BaseException:
            self._shutdown()
            raise

    def _consumers_field(self) -> dict[str, object]:
        if len(self.lanes) == 1:
            return {}
        return {
            "consumers": {
                name: {
                    "kind": type(lane.consumer).__name__,
                    "position": str(lane.position) if lane.position else None,
                    "realtime": lane.markers,
                }
                for name, lane in self.lanes.items()
            }
        }

    def _lowest(self) -> int | None:
        """The lowest segment any consumer still needs (None: one needs every link). An invalidated consumer
        needs none."""
        segments = []
        for lane in self.lanes.values():
            if lane.invalidated:
                continue
            pos = lane.position
            if pos is None:
                return None
            segments.append(pos.segment)
        return min(segments) if segments else None

    def _check_caps(self) -> None:
        """Invalidate every consumer holding back more link bytes than its ``max_retained_bytes``."""
        capped = [lane for lane in self.lanes.values() if lane.policy.max_retained_bytes and not lane.invalidated]
        if not capped:
            return
        links, _ = list_segments(self.cdc_dir)
        sizes = {}
        for seg, path in links.items():
            with contextlib.suppress(FileNotFoundError):
                sizes[seg] = path.stat().st_size
        for lane in capped:
            pos = lane.position
            retained = sum(size for seg, size in sizes.items() if pos is None or seg >= pos.segment)
            if retained > lane.policy.max_retained_bytes:
                lane.invalidate(retained)

    def _retained_bytes(self, lane: Lane) -> float:
        """Bytes of the links from ``lane``'s position on (at scrape time); an invalidated one holds none."""
        if lane.invalidated:
            return 0.0
        pos = lane.position
        links, _ = list_segments(self.cdc_dir)
        held = 0
        for seg, path in links.items():
            if pos is None or seg >= pos.segment:
                with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                    held += path.stat().st_size
        return float(held)

    def _others_live(self, name: str) -> bool:
        """Whether a consumer other than ``name`` is live (at the head and delivering): ``name``, if it is behind,
        catches up at most at its ``catchup_max_share`` then."""
        return any(lane.live() for other, lane in self.lanes.items() if other != name)

    def _release(self, name: str, segment: int) -> list[int]:
        """Consumer ``name`` committed past ``segment``: delete the links below the lowest position of all
        (Ignite's rule, with the minimum over consumers). Called from the consumers' worker threads."""
        lane = self.lanes[name]
        if len(self.lanes) == 1 and not lane.policy.max_retained_bytes:
            return delete_links_below(self.cdc_dir, segment)
        with self._links_lock:
            self._check_caps()
            if lane.invalidated and lane.failure is not None:
                raise lane.failure  # its commit is durable; it stops here, holding nothing
            low = self._lowest()  # this consumer's position, just committed, among them
            return delete_links_below(self.cdc_dir, low) if low is not None else []

    def stop(self) -> None:
        """Ask a running ``run()`` to finish its in-flight batches and return (thread- and signal-safe)."""
        self._stopping.set()
        for lane in self.lanes.values():
            lane.stopping.set()
            lane.interrupt()
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        self._stopping.set()
        for lane in self.lanes.values():
            lane.stopping.set()
        self._shutdown()

    def _shutdown(self) -> None:
        if any(lane.watch.stalled is not None for lane in self.lanes.values()):
            # A worker thread is still inside a consumer or a state store: leave both to the
            # process exit (the state is durable up to the last commit; the lock dies with us).
            return
        for lane in self.lanes.values():
            lane.shutdown()
        self._lock.release()
        if self._started:
            self._started = False
            shared = self.shared
            reads = {"shared_reads": {"hits": shared.hits, "misses": shared.misses}} if shared is not None else {}
            log.info("daemon_stopped", node_dir=self.config.node_dir, **reads)

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
        """The ``default`` (or first) consumer's committed state."""
        state = self._primary.committed_state()
        assert state is not None, "daemon not started"
        return state

    @property
    def events_delivered(self) -> int:
        """Events the ``default`` (or first) consumer took."""
        committer = self._primary.committer
        return committer.events_delivered if committer else 0

    @property
    def failures(self) -> dict[str, BaseException]:
        """Consumers that stopped for good, with why."""
        return {name: lane.failure for name, lane in self.lanes.items() if lane.failure is not None}

    def _learnt(self, follower: SegmentFollower) -> uuid.UUID | None:
        """The node id, learnt from the first segment read when the node dir does not say it."""
        if self.node_id is None and follower.expect_node_id is not None:
            self.node_id = follower.expect_node_id
            for lane in self.lanes.values():
                lane.node_id = self.node_id
        return self.node_id

    # --- one pass, synchronously -----------------------------------------------------------------
    def sync_once(self) -> int:
        """Process everything the CDC dir holds now (across mode switches), consumer after consumer;
        returns the events the ``default`` (or first) consumer took."""
        delivered = 0
        for lane in self.lanes.values():
            if lane.failure is not None:
                continue
            n = lane.sync_once(self.node_id, self._learnt)
            if lane.follower is not None:
                self._learnt(lane.follower)
            if lane is self._primary:
                delivered = n
        return delivered

    # --- the long-running form -------------------------------------------------------------------
    async def run(self) -> None:
        """Run until ``stop()``; raises on anything unexpected (the caller exits non-zero). With several
        consumers, one that fails stops alone (``failures``); the daemon raises once all have, or, at
        ``stop()``, the first failure."""
        if not self._started:
            await asyncio.to_thread(self.start)
        loop = asyncio.get_running_loop()
        self._loop, self._stop_event = loop, asyncio.Event()
        if self._stopping.is_set():
            self._stop_event.set()
        wakes = []
        for lane in self.lanes.values():
            wakes.append(lane.begin_run())
        observer = Observer()
        observer.schedule(_Wake(loop, wakes), str(self.cdc_dir), recursive=False)
        observer.start()
        self._notifier.ready(f"following {self.cdc_dir}")
        stopping = self._stop_event

        async def passes(lane: Lane) -> None:
            try:
                while not self._stopping.is_set():
                    if lane.invalidated and lane.failure is not None:
                        raise lane.failure
                    node_id = self._learnt(lane.follower) if lane.follower is not None else self.node_id
                    await lane.run_pass(node_id, stopping)
            except PipelineStalled:
                raise
            except Exception as exc:
                if len(self.lanes) == 1:
                    raise
                lane.stopped_for_good(exc)
                if all(other.failure is not None for other in self.lanes.values()):
                    first = next(iter(self.failures.items()))
                    raise ConsumerStopped(*first) from first[1]

        lanes = [lane for lane in self.lanes.values() if lane.failure is None]  # not those that failed to start
        lane_tasks = [asyncio.create_task(passes(lane), name=f"cdcd-passes-{lane.name}") for lane in lanes]
        monitor_tasks = [asyncio.create_task(lane.watch.monitor(), name=f"cdcd-monitor-{lane.name}") for lane in lanes]
        try:
            # A monitor ends only by raising PipelineStalled; the passes end on stop() or an error.
            pending: set[asyncio.Task[None]] = {*lane_tasks, *monitor_tasks}
            while any(t in pending for t in lane_tasks):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # raises a stall, or the failure of the last consumer (of the only one)
            failures = self.failures
            if failures:
                name, exc = next(iter(failures.items()))
                raise ConsumerStopped(name, exc) from exc
        finally:
            self._notifier.stopping()
            for task in (*monitor_tasks, *lane_tasks):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            observer.stop()
            await asyncio.to_thread(observer.join)
            self._watch.end_progress()


__all__ = ["CacheInfo", "ConsumerStopped", "Daemon", "PipelineStalled", "daemon_lock", "end_of_read"]
