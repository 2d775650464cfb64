"""One consumer of a daemon: its state, its passes over the CDC dir, its committer (issue 45).

A daemon has one lane per consumer (``[consumer]`` is the lane named ``default``). Each lane owns
its position, mode, cache registry and commits, in an LMDB state of its own, bound to its consumer's
identity; each reads from its own position with its own follower, through the daemon's shared
decoded chunks (``SharedReads``), so lanes that keep up read and decode a segment once between them
and a lane that falls behind reads on its own without holding the others back. Only the daemon's
``realtime_consumer`` lane follows the node's hand-over markers; the others are always ACTIVE.

Every lane runs in this one process, on its CPU and under its GIL: a lane catching up over a backlog would take
them from the lanes at the head, whose lag is what users see. While at least one other lane is live, a lane
behind works at most ``catchup_max_share`` of the time (``Throttle``); alone, or with every lane behind, it
goes at full speed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from prometheus_client import REGISTRY

from cdcd import metrics
from cdcd.config import CacheFilter
from cdcd.consumer import Consumer, DeliveryPolicy, as_consumer
from cdcd.daemon.committer import Committer, ConsumerFailed
from cdcd.daemon.config import DEFAULT_CONSUMER, DaemonConfig, lane_policy
from cdcd.daemon.follower import ReadItem, SegmentFollower, SharedReads
from cdcd.daemon.processor import Batch, Item, Processor, Switch
from cdcd.daemon.rewind import rewind
from cdcd.daemon.start_state import load_start_state
from cdcd.daemon.watch import Watch
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.durable import write_atomic
from cdcd.faults import ExitCode, Fault
from cdcd.logging import describe
from cdcd.wal.errors import WalError
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import DataRecord
from cdcd.wal.segment import list_segments

if TYPE_CHECKING:
    from cdcd.daemon.sdnotify import Notifier

log = structlog.get_logger("cdcd.daemon")

_PASSIVE_SKIP = frozenset({DataRecord.TYPE})

STOPPED_FILE = "stopped.json"
"""In a consumer's state dir: why it stopped for good (``cdcd state show``), removed at its next start."""
INVALIDATED_FILE = "invalidated.json"
"""In a consumer's state dir: it was invalidated (``max_retained_bytes``); removed by ``cdcd state reset``."""


RECENT_CALLS = 8
"""The consumer's calls ``Lane._holds`` compares the one in progress with."""


class ConsumerInvalidated(Fault, Exception):
    """A consumer held back more than its ``max_retained_bytes``: it stops and holds no link any more."""

    exit_code = ExitCode.BAD_STATE


class Throttle:
    """A duty cycle for one stage of a lane catching up: after each step of ``seconds``, no next step for
    ``seconds * (1 - share) / share``, while ``engaged()`` (this lane behind, another live). The reader, the
    decoder and the consumer each have one: each stage works at most ``share`` of the time, so the lane takes
    at most ``share`` of what it takes at full speed, and catches up that much slower (one clock for all three
    would serialise stages that overlap at full speed). ``say``: the one of the lane that logs its changes."""

    def __init__(self, name: str, share: float, engaged: Callable[[], bool], *, say: bool = False) -> None:
        self.name = name
        self.share = share
        self.engaged = engaged
        self.say = say
        self._until = 0.0
        self.on = False
        """Engaged at the last step (the log says when it changes)."""
        self.waited_s = 0.0
        """Seconds its steps were held back, in all."""

    def charge(self, seconds: float) -> None:
        if self.share >= 1.0:
            return
        engaged = self.engaged()
        if engaged != self.on and self.say:
            log.info(
                "consumer_catchup_throttled" if engaged else "consumer_catchup_unthrottled",
                consumer=self.name,
                catchup_max_share=self.share,
                waited_s=round(self.waited_s, 1),
            )
        self.on = engaged
        if engaged:
            self._until = max(self._until, time.monotonic()) + seconds * (1.0 - self.share) / self.share

    async def wait(self, stopping: asyncio.Event | None = None) -> None:
        """Until the lane may take its next step (at once when not engaged any more, or on ``stopping``)."""
        delay = self._until - time.monotonic()
        if delay <= 0:
            return
        if not self.engaged():
            self._until = 0.0  # the live lanes caught up with it, or stopped: full speed from here
            return
        self.waited_s += delay
        if stopping is None:
            await asyncio.sleep(delay)  # the reader and the decoder: cancelled when their pass ends
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stopping.wait()


class Lane:
    """One named consumer of the daemon. ``primary``: the lane the unlabelled metric families describe
    (``default``, else the first consumer)."""

    def __init__(
        self,
        config: DaemonConfig,
        name: str,
        consumer: Consumer,
        *,
        identity: str,
        markers: bool,
        primary: bool,
        notifier: Notifier,
        stopping: threading.Event,
        shared: SharedReads | None,
        release: Callable[[int], list[int]],
        show_progress: bool,
        others_live: Callable[[], bool] = lambda: False,
    ) -> None:
        """``others_live()``: whether another lane of the daemon is live (``live()``), which engages this
        lane's ``Throttle`` while it is behind."""
        self.config = config
        self.name = name
        self.consumer = as_consumer(consumer)
        self.identity = identity
        self.markers = markers
        self.primary = primary
        self.table = config.named_consumers().get(name, {"kind": "null"})
        self.policy = lane_policy(self.table, config.consumer_key(name), config.catchup_max_share)
        self.delivery = DeliveryPolicy.from_table(self.table, config.consumer_key(name))
        """Retries and dead letters: read once, from the table ``cdcd.sinks.load_consumer`` built the consumer of."""
        self.invalidated = False
        """Past ``max_retained_bytes``: its position holds no link; it stays stopped until ``state reset``."""
        self.selected = CacheFilter.from_table(self.table, config.consumer_key(name))
        """The consumer table's ``caches``/``exclude_caches``: applied by the batcher, so a cache left
        out is neither delivered, counted nor announced."""
        self.state_path = config.consumer_state_path(name)
        self.cdc_dir = config.cdc_path
        self.stopping = stopping
        """This consumer's own stop: set when the daemon stops, or when it is invalidated (mid-retry too)."""
        self.shared = shared
        self.lazy_entries = False
        """Set by the daemon when none of its consumers reads entries one by one (``Consumer.decodes_entries``)."""
        self.release = release
        self.store: StateStore | None = None
        self.committer: Committer | None = None
        self.start_state: DaemonState | None = None
        self.consumer_started = False
        self.failure: BaseException | None = None
        """Why this consumer stopped for good (the others go on)."""
        self.node_id: uuid.UUID | None = None
        self.follower: SegmentFollower | None = None
        self.wake: asyncio.Event | None = None
        self._read_q: asyncio.Queue[list[ReadItem] | WalError | None] | None = None
        self._item_q: asyncio.Queue[Item | WalError] | None = None
        """The pipeline's bounded queues (``queue_max_batches``), made once per run, kept across passes."""
        self._asking = False
        """The consumer stage waits for its next item (it is not in a call, nor has one to start)."""
        self._asked: asyncio.Event | None = None
        """Set whenever ``_asking`` changes (a decoder holding a batch waits on it)."""
        self._call_began: float | None = None
        """Monotonic time the consumer's call in progress began (None between calls)."""
        self._calls_s: collections.deque[float] = collections.deque(maxlen=RECENT_CALLS)
        """How long its last calls with events took (a call far longer than these is a stall, not a slow sink)."""
        self._holding = False
        """The decoder holds a due batch open (``_holds``): what it took is queued too, so the lane is not at the
        end yet, however empty its queues."""
        self.watch = Watch(config, notifier, self.committed_state, show_progress=show_progress and primary)
        self._retried = False
        """The consumer call in flight waited out a retriable error (``_retry_step``)."""
        self.catching_up = True
        """Over a backlog: from its start, or from an outage of its target (a retried call), until its consumer
        finds nothing queued with its reader at the end of the CDC dir (the reader alone gets there long before:
        its queues hold whole batches). A lane that was at the head and falls behind under load is not: it is
        one of the live lanes the throttle is for."""
        self._read_all = False
        """The reader's last read found the end of the CDC dir."""
        share = self.policy.catchup_max_share
        behind = functools.partial(self._behind, others_live)
        self.throttles = {stage: Throttle(name, share, behind) for stage in ("reader", "decoder")}
        self.throttle = Throttle(name, share, behind, say=True)
        """The consumer stage's (the others': ``throttles``)."""

    # --- start and stop --------------------------------------------------------------------------
    def load(self, node_id: uuid.UUID | None) -> uuid.UUID | None:
        """Open this consumer's state (refusing one of another node or consumer); returns the node id."""
        self.store = StateStore(self.state_path)
        with contextlib.suppress(FileNotFoundError):
            (self.state_path / STOPPED_FILE).unlink()  # it is tried again
        try:
            found = msgspec.json.decode((self.state_path / INVALIDATED_FILE).read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            found = None
        if found is not None:
            self.invalidated = True
            self.stopped_for_good(ConsumerInvalidated(str(found.get("error", "invalidated"))))
            return node_id
        fresh = not self.store.has_state()
        state, caches, node_id = load_start_state(
            self.config, self.store, node_id, name=self.name, identity=self.identity, markers=self.markers
        )
        if fresh and self.policy.start == "now" and state.mode is CdcMode.DAEMON_ACTIVE:
            state = self._start_now(state)
        if not self.markers and state.mode is not CdcMode.DAEMON_ACTIVE:
            # Its position was the node's realtime worker's; from here on this daemon delivers to it from the
            # archive (another consumer is the daemon's realtime_consumer).
            log.warning(
                "consumer_not_realtime",
                consumer=self.name,
                position=str(state.position) if state.position else None,
                realtime_consumer=self.config.handover_consumer,
                detail="its state was PASSIVE; it is delivered from the archive from its position on",
            )
            state = self.store.commit(msgspec.structs.replace(state, mode=CdcMode.DAEMON_ACTIVE))
        self.node_id = node_id
        self.start_state = state
        self._caches = caches
        return node_id

    def start(self) -> None:
        """Start the consumer, move back to what its target holds, and announce the caches it knows."""
        assert self.store is not None and self.start_state is not None
        try:
            self.consumer.start(REGISTRY)
            self.consumer_started = True
        except Exception as exc:
            raise ConsumerFailed(f"consumer start() raised {describe(exc)}") from exc
        # Before links are deleted: a target behind the position is re-delivered from them.
        state = self.rewind(self.start_state)
        self.start_state = state
        retrying = self._retry_step
        self.committer = Committer(
            self.store,
            state,
            self._caches,
            self.consumer,
            self.cdc_dir,
            policy=self.delivery,
            stopping=self.stopping,
            retrying=retrying,
            rewind=self.rewind,
            release=self.release,
            name=self.name,
            primary=self.primary,
        )
        self.committer.announce([i for i in self._caches.values() if i.config.cdc_enabled and self.selected(i.name)])
        metrics.DAEMON_CONSUMER_LAG_SECONDS.labels(self.name).set_function(self.watch.lag_seconds)

    def _retry_step(self) -> None:
        """A backoff step of the consumer's call (on its worker thread): not a stall, and not work to charge
        to the catch-up throttle (an outage waited out is no CPU taken from the others)."""
        self.watch.touch("consumer")
        self._retried = True
        self.catching_up = True  # what its target missed meanwhile is a backlog once it is back

    def _start_now(self, state: DaemonState) -> DaemonState:
        """``start = "now"``: after the newest segment archived (linked or not), not at the oldest link."""
        links, _ = list_segments(self.cdc_dir)
        archive = self.config.node().archive_path
        archived, _ = list_segments(archive) if archive.is_dir() else ({}, [])
        newest = max([*links, *archived], default=None)
        if newest is None:
            return state  # nothing archived yet: the oldest link is now
        assert self.store is not None
        state = self.store.commit(msgspec.structs.replace(state, position=WalPosition(newest + 1, 0, 0)))
        log.info("consumer_starts_now", consumer=self.name, position=str(state.position))
        return state

    def invalidate(self, retained: int) -> None:
        """Past ``max_retained_bytes``: stop for good, hold no link (one line naming it, its position, the way back)."""
        self.invalidated = True
        error = (
            f"consumer {self.name} invalidated: it holds {retained} bytes of links from its position "
            f"{self.position or 'the oldest link'} on, over max_retained_bytes = {self.policy.max_retained_bytes}; "
            f"its links are released. The way back: stop the daemon, `cdcd state reset --config F --consumer "
            f"{self.name}` (from the oldest link), then `cdcd control resend <cache>` for what it missed"
        )
        metrics.DAEMON_CONSUMER_INVALIDATIONS.labels(self.name).inc()
        record = {"error": error, "at": time.time(), "position": str(self.position or ""), "retained": retained}
        with contextlib.suppress(OSError):
            write_atomic(self.state_path / INVALIDATED_FILE, msgspec.json.encode(record))
        log.error("consumer_invalidated", consumer=self.name, retained_bytes=retained, error=error)
        self.stopping.set()  # its delivery loop gives up at its next step, also in the middle of retries
        self.interrupt()
        self.stopped_for_good(ConsumerInvalidated(error))

    @property
    def position(self) -> WalPosition | None:
        """The committed position (the loaded one before the committer exists)."""
        if self.committer is not None:
            return self.committer.state.position
        return self.start_state.position if self.start_state is not None else None

    def _behind(self, others_live: Callable[[], bool]) -> bool:
        return self.catching_up and others_live()

    def live(self) -> bool:
        """Not catching up and delivering (not retrying an outage, not stopped): a lane whose lag the others'
        catching up must not take the process's cores and GIL from."""
        return not self.catching_up and self.failure is None and not self.invalidated and self.watch.retrying is None

    def committed_state(self) -> DaemonState | None:
        return self.committer.state if self.committer is not None else None

    def rewind(self, state: DaemonState) -> DaemonState:
        """At start and at a switch to ACTIVE: back to where the consumer's target stops holding what was
        delivered (``daemon/rewind.py``)."""
        assert self.store is not None
        return rewind(self.config, self.store, state, self.consumer, str(self.node_id) if self.node_id else "")

    def interrupt(self) -> None:
        self.consumer.interrupt()

    def shutdown(self) -> None:
        if self.watch.stalled is not None:
            return  # a worker thread is still inside the consumer or the store: left to the process exit
        if self.consumer_started:
            self.consumer_started = False
            self._settle_at_stop()
            self.consumer.stop()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _settle_at_stop(self) -> None:
        """Whatever way the delivery ended (a stop, a pass cut short), what the consumer took unconfirmed is
        confirmed and committed if it can say so at once, not read again at the next start; a consumer that
        failed is not asked."""
        committer = self.committer
        if committer is None or not committer.unconfirmed or self.failure is not None:
            return
        try:
            committer.settle()
        except ConsumerFailed as exc:
            log.warning(
                "consumer_not_confirmed_at_stop",
                consumer=self.name,
                error=str(exc),
                detail="what it took since the last commit is delivered again at the next start",
            )

    def stopped_for_good(self, exc: BaseException) -> None:
        """This consumer failed: it delivers no more (its position keeps holding its links); the others go on."""
        if isinstance(self.failure, ConsumerInvalidated):
            return  # its pass ended because it was invalidated, which was said then
        self.failure = exc
        code, line = failure_line(exc)
        metrics.DAEMON_CONSUMER_UP.labels(self.name).set(0)
        stopped = {"exit_code": int(code), "error": line, "at": time.time(), "position": str(self.position or "")}
        with contextlib.suppress(OSError):  # what `cdcd state show` says about it; the log line says it too
            write_atomic(self.state_path / STOPPED_FILE, msgspec.json.encode(stopped))
        log.error(
            "consumer_stopped",
            consumer=self.name,
            exit_code=code,
            error=line,
            position=str(self.position) if self.position else None,
            hint="the other consumers go on; this one's links are kept until it is fixed and the daemon restarted",
        )

    # --- one pass, synchronously -----------------------------------------------------------------
    def new_pass(self, node_id: uuid.UUID | None) -> tuple[Processor, SegmentFollower]:
        committer = self.committer
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
            markers=self.markers,
        )
        skip = _PASSIVE_SKIP if processor.mode is CdcMode.NODE_ACTIVE else frozenset()
        if node_id is not None and not state.node_id:
            committer.state = state = msgspec.structs.replace(state, node_id=str(node_id))
        self.follower = SegmentFollower(
            self.cdc_dir,
            state.position,
            skip_types=skip,
            expect_node_id=node_id,
            shared=self.shared,
            lazy_entries=self.lazy_entries,
        )
        return processor, self.follower

    def sync_once(self, node_id: uuid.UUID | None, learnt: Callable[[SegmentFollower], uuid.UUID | None]) -> int:
        """Process everything the CDC dir holds now (across mode switches); returns events delivered."""
        committer = self.committer
        assert committer is not None, "daemon not started"
        before = committer.events_delivered
        processor, follower = self.new_pass(node_id)
        while True:
            chunk = read_chunk(follower, self.config.read_chunk_records)
            if chunk is None or isinstance(chunk, WalError):
                for item in end_of_read(processor, committer, chunk):
                    if isinstance(item, WalError):
                        committer.settle()
                        raise item
                    committer.apply(item)
                committer.settle()  # what the consumer took unconfirmed, confirmed and committed
                return committer.events_delivered - before
            processor.source_node = follower.node_id
            for item in processor.feed_many(chunk):
                committer.apply(item)
            if processor.finished:
                node_id = learnt(follower)
                processor, follower = self.new_pass(node_id)

    # --- the long-running form -------------------------------------------------------------------
    def begin_run(self) -> asyncio.Event:
        """In ``Daemon.run``'s event loop: the lane's wake event and queues; returns the wake event."""
        self.wake = asyncio.Event()
        self._read_q = asyncio.Queue(self.config.queue_max_batches)
        self._item_q = asyncio.Queue(self.config.queue_max_batches)
        self._asked = asyncio.Event()
        return self.wake

    async def run_pass(self, node_id: uuid.UUID | None, stopping: asyncio.Event) -> None:
        """One pass in one mode, until a mode switch or stop(): the reader, decoder and consumer tasks
        over the lane's two bounded queues (emptied first: what a pass left behind is read again)."""
        processor, follower = self.new_pass(node_id)
        assert self._read_q is not None and self._item_q is not None, "begin_run() first"
        for q in (self._read_q, self._item_q):
            while not q.empty():
                q.get_nowait()
        tasks = [
            asyncio.create_task(self._reader(processor, follower), name=f"cdcd-reader-{self.name}"),
            asyncio.create_task(self._decoder(processor, follower), name=f"cdcd-decoder-{self.name}"),
        ]
        consumer_task = asyncio.create_task(self._consume(follower, stopping), name=f"cdcd-consumer-{self.name}")
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

    async def _reader(self, processor: Processor, follower: SegmentFollower) -> None:
        config, watch, wake, read_q = self.config, self.watch, self.wake, self._read_q
        throttle = self.throttles["reader"]
        assert wake is not None and read_q is not None
        check_s = config.check_interval_ms / 1000
        while True:
            await throttle.wait()
            began = time.monotonic()
            chunk = await watch.in_thread(
                "reader", f"reading segment {follower.segment}", read_chunk, follower, config.read_chunk_records
            )
            self._read_all = chunk is None
            if (
                chunk is None
                and read_q.empty()
                and self._item_q is not None
                and self._item_q.empty()
                and not self._holding
            ):
                self.catching_up = False  # at the end with nothing queued (the consumer may be on its last batch)
            if chunk is not None:
                throttle.charge(time.monotonic() - began)
            if isinstance(chunk, WalError):
                await read_q.put(chunk)  # the decoder delivers what came before it, then the consumer raises it
                return
            if follower.segment is not None and self.primary:
                metrics.DAEMON_CURRENT_SEGMENT.set(follower.segment)
            if chunk:
                watch.read(chunk[0][0].segment, chunk[-1][0].segment)
            if chunk is None:
                await read_q.put(None)  # caught up: the decoder closes its batch now
                if processor.mode is CdcMode.DAEMON_ACTIVE:
                    await asyncio.to_thread(watch.peek_active_segment, follower)
                wake.clear()
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                # races with the wake-up, and stop() would then hang on a full queue.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(check_s):
                        await wake.wait()
                continue
            await read_q.put(chunk)

    async def _decoder(self, processor: Processor, follower: SegmentFollower) -> None:
        committer, read_q, item_q, asked = self.committer, self._read_q, self._item_q, self._asked
        assert committer is not None and read_q is not None and item_q is not None and asked is not None
        throttle = self.throttles["decoder"]
        delay_s = self.config.batch_max_delay_ms / 1000
        get: asyncio.Future[list[ReadItem] | WalError | None] | None = None
        held: bool | None = None
        """The open batch is due (the reader caught up: False, or ``batch_max_delay_ms`` passed: True) while the
        consumer is busy: it stays open, taking what is read meanwhile, until the consumer asks for its next
        item (``_holds``)."""
        try:
            while True:
                if held is not None and not self._holds(item_q):
                    for item in end_of_read(processor, committer, None, timed_out=held):
                        await item_q.put(item)
                    held = None
                    self._holding = False
                chunk: list[ReadItem] | WalError | None
                timed_out = False
                if get is None and not read_q.empty():
                    chunk = read_q.get_nowait()
                else:
                    timeout = None
                    if processor.batch_started is not None and held is None:
                        timeout = max(0.0, processor.batch_started + delay_s - time.monotonic())
                    elif held is not None:
                        timeout = self._hold_left()
                    if get is None:
                        get = asyncio.ensure_future(read_q.get())
                    waits: set[asyncio.Future[Any]] = {get}
                    if held is not None:
                        asked.clear()
                        waits.add(asyncio.ensure_future(asked.wait()))
                    try:
                        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for waiting in waits - {get}:
                            waiting.cancel()
                    if get in done:
                        chunk, get = get.result(), None
                    elif held is not None:
                        continue  # the consumer asks, took a batch, or its call became a stall: look again
                    else:
                        chunk, timed_out = None, True
                if chunk is None and self._holds(item_q):
                    held = timed_out and held is not False  # caught up once while held: it commits its position
                    self._holding = True
                    continue
                if chunk is None or isinstance(chunk, WalError):
                    # Caught up (segments arrive whole, waiting adds only lag), batch_max_delay_ms
                    # passed, or a bad spot.
                    held = None
                    self._holding = False
                    for item in end_of_read(processor, committer, chunk, timed_out=timed_out):
                        await item_q.put(item)
                    if chunk is None:
                        continue
                    return
                processor.source_node = follower.node_id
                await throttle.wait()
                began = time.monotonic()
                items = processor.feed_many(chunk)
                throttle.charge(time.monotonic() - began)
                for item in items:
                    await item_q.put(item)
                if processor.finished:
                    return
        finally:
            self._holding = False  # what it held is read again by the next pass
            if get is not None:
                get.cancel()  # the queue outlives the pass: no getter of this one may take the next pass's chunk

    def _holds(self, item_q: asyncio.Queue[Item | WalError]) -> bool:
        """Whether a due batch stays open: the lane is live (a lane catching up keeps its batches, and its
        throttle's steps, as they come) and its consumer is busy (in a call, or with an item queued). A
        consumer slower than the writes then takes what came during its last call in one batch, and its lag
        stays about one of its calls, where batches cut at every segment would queue up behind it. Not for
        a call that has lasted over twice its recent ones (a sink waiting out an outage: Kafka's commit
        waits its transaction timeout before it fails), which would get batches of ``batch_max_events``
        after it instead."""
        if self.catching_up or (self._asking and item_q.empty()):
            return False
        left = self._hold_left()
        return left is None or left > 0

    def _hold_left(self) -> float | None:
        """Seconds the call in progress is still held for (None: no call in progress)."""
        began = self._call_began
        if began is None:
            return None
        allowed = 2 * max(self._calls_s, default=0.0) + self.config.batch_max_delay_ms / 1000
        return max(0.0, began + allowed - time.monotonic())

    async def _consume(self, follower: SegmentFollower, stopping: asyncio.Event) -> None:
        committer, watch, item_q, primary = self.committer, self.watch, self._item_q, self.primary
        assert committer is not None and item_q is not None
        check_s = self.config.check_interval_ms / 1000
        get: asyncio.Future[Any] | None = None
        applied = False
        try:
            while True:
                if item_q.empty() and self._read_all and not self._holding:
                    self.catching_up = False
                if applied and committer.unconfirmed and item_q.empty() and not self.catching_up:
                    await self._settle(follower)  # nothing more to deliver: what it holds is confirmed now
                applied = False
                if get is None:
                    get = asyncio.ensure_future(item_q.get())
                    self._ask(True)
                stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
                done, _ = await asyncio.wait({get, stop_wait}, timeout=check_s, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                if stop_wait in done:
                    return
                if get not in done:
                    if self.stopping.is_set():  # invalidated: this consumer stops, the daemon goes on
                        return
                    if committer.unconfirmed:  # nothing came for a poll interval: ask it again to confirm
                        await self._settle(follower)
                        continue
                    # Idle: ask the consumer on every poll whether it can still take events (Ignite
                    # IGNITE-18249), so a dead sink ends the daemon even when nothing is written.
                    await asyncio.shield(watch.in_thread("consumer", "consumer alive()", committer.check_alive))
                    continue
                item, get = get.result(), None
                self._ask(False)
                if isinstance(item, WalError):
                    if committer.unconfirmed:  # what came before the bad spot is delivered and committed first
                        await self._settle(follower)
                    raise item
                batch = isinstance(item, Batch) and len(item.events) > 0
                if batch:
                    await self.throttle.wait(stopping)
                    if stopping.is_set():
                        return  # not started: the next run reads it again from the committed position
                what = type(item).__name__
                if isinstance(item, Batch) and len(item.events):
                    events = item.events
                    what = f"consumer on_events() with {len(events)} events from {events.first}"
                    if primary:
                        watch.batch_started(events)
                    elif watch.oldest_unconfirmed_ns is None:
                        watch.oldest_unconfirmed_ns = events.peek_slices()[0].record.commit_ts_ns
                began, self._retried = time.monotonic(), False
                if batch:
                    self._call_began = began
                try:
                    # Shielded: a started batch finishes (and commits if confirmed) even on shutdown.
                    await asyncio.shield(watch.in_thread("consumer", what, committer.apply, item))
                finally:
                    self._call_began = None
                if batch and not self._retried:
                    self.throttle.charge(time.monotonic() - began)
                    self._calls_s.append(time.monotonic() - began)
                self._watch_committed(follower)
                if isinstance(item, Switch) or self.stopping.is_set():
                    return
                applied = True
        finally:
            self._ask(False)
            if get is not None:
                get.cancel()  # the queue outlives the pass: no getter of this one may take the next pass's item

    async def _settle(self, follower: SegmentFollower) -> None:
        """The consumer confirms what it took unconfirmed, now that nothing is queued for it (a call of its own,
        as a batch's: the decoder holds what is read meanwhile)."""
        committer, watch = self.committer, self.watch
        assert committer is not None
        began = self._call_began = time.monotonic()
        try:
            await asyncio.shield(watch.in_thread("consumer", "consumer on_events() confirming", committer.settle))
        finally:
            self._call_began = None
        self._calls_s.append(time.monotonic() - began)  # the work a quick False left for it: the hold's measure
        self._watch_committed(follower)

    def _watch_committed(self, follower: SegmentFollower) -> None:
        """After a consumer call: the watch learns what is committed (and whether anything waits unconfirmed)."""
        committer, watch = self.committer, self.watch
        assert committer is not None
        if self.primary:
            watch.committed(committer.state.position, unconfirmed=committer.unconfirmed, follower=follower)
        elif not committer.unconfirmed:
            watch.oldest_unconfirmed_ns = None

    def _ask(self, asking: bool) -> None:
        self._asking = asking
        if self._asked is not None:
            self._asked.set()


def failure_line(exc: BaseException) -> tuple[ExitCode, str]:
    """(exit code, one line) of a consumer's failure, as ``cdcd.cli.exits`` makes them (the command line
    is above the daemon): a fault's own code and hint, anything else exit 1 with its type."""
    if isinstance(exc, Fault):
        message = str(exc)
        hint = exc.hint
        return exc.exit_code, f"{message} ({hint})" if hint and not message.endswith(hint) else message
    return ExitCode.FAILED, describe(exc)


def read_chunk(follower: SegmentFollower, records: int) -> list[ReadItem] | WalError | None:
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


__all__ = ["DEFAULT_CONSUMER", "Lane", "end_of_read", "failure_line", "read_chunk"]
