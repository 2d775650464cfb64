"""The realtime worker's deliveries: buffered records through the shared batcher, ACTIVE
dispatch and delivery loop (``cdcd.delivery``) to the consumer, then the commit.

Runs on the worker thread only; the machine is read and fed under the worker's condition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import structlog

from cdcd import dead_letters, metrics
from cdcd.config import CacheFilter
from cdcd.consumer import EventBatch, LoadedConsumer, RecordSlice
from cdcd.delivery import Batch, Batcher, DeliveryFailed, DeliveryLoop, feed_active
from cdcd.node.config import NodeConfig
from cdcd.node.wal_log import WalLog
from cdcd.realtime.machine import RealtimeMachine
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.reader import iter_chunk
from cdcd.wal.records import CacheInfo, DataRecord, Record

log = structlog.get_logger("cdcd.realtime")

_RETRY_S = 0.02
"""Retry policy for a consumer call that took nothing: offer the rest again after this (or at a stop)."""
T = TypeVar("T")
_NO_BYTE_BOUND = 1 << 62
"""Realtime batches are bounded by events only (the buffer already bounds the bytes)."""


class Stopped(Exception):
    """Realtime stopped in the middle of a delivery (consumer error, or a stop request)."""


class Deliverer:
    def __init__(
        self,
        machine: RealtimeMachine,
        cv: threading.Condition,
        config: NodeConfig,
        wal: WalLog,
        node_id: str,
        *,
        caches: Callable[[], dict[int, CacheInfo]],
        consumer: Callable[[], LoadedConsumer],
        committed: Callable[[], None],
        stop: Callable[[str, bool], None],
    ) -> None:
        """``committed()`` runs under ``cv`` after each commit (the marker cadence); ``stop(reason,
        consumer_failed)`` stops realtime."""
        self.machine = machine
        self._cv = cv
        self.config = config
        self.wal = wal
        self.node_id = node_id
        self._caches = caches
        selected = CacheFilter.from_table(config.realtime_consumer, "realtime_consumer")
        self._selected = None if selected.everything else selected
        """The consumer table's ``caches``/``exclude_caches`` (checked with the node config)."""
        self._consumer = consumer
        self._committed = committed
        self._stop = stop
        self.last_event_ts_ns = 0
        self._taken: WalPointer | None = None
        """The last data record the consumer took (committed with the position it confirms)."""
        self.loop: DeliveryLoop | None = None
        """The current run's loop, with the consumer and policy of that run."""
        self.batcher: Batcher | None = None
        """Batches and cache changes of the current run of deliveries (None: a new run begins)."""
        self._names: dict[int, str] = {}
        """Names of the node's caches, kept for events of a cache destroyed meanwhile."""
        self._started_s: float | None = None
        """When the last delivery began (monotonic), for ``realtime_batch_min_interval_ms``."""

    def stopped(self) -> None:
        """Realtime stopped: the next delivery is a new run (a fresh consumer hears of every cache)."""
        self.batcher = None

    def _records(self) -> Iterator[tuple[WalPointer, Record, int]]:
        """Buffered records in WAL order from the delivery start, with how many entries of each were
        delivered before; ends when the buffer is empty or a stop is asked for (no new batch after it)."""
        machine = self.machine
        while True:
            with self._cv:
                taken = machine.take()
            if taken is None:
                return
            source, _size = taken
            metrics.RT_BUFFER_BYTES.set(machine.buffered_bytes)
            items = source if isinstance(source, list) else iter_chunk(source.data, source.segment, source.offset)
            for ptr, record, _rsize in items:
                if machine.stopping:
                    return
                done = machine.entries_done(ptr, record)
                if done is not None:
                    yield ptr, record, done

    def _paced(self) -> None:
        """Wait out the rest of ``realtime_batch_min_interval_ms`` (or the consumer's ``min_batch_interval_ms``,
        the longer) since the last delivery began (what is offered meanwhile joins this one), unless stopping,
        closing or the buffer is half full."""
        asked_ms = self.loop.consumer.min_batch_interval_ms if self.loop is not None else 0
        interval_s = max(self.config.realtime_batch_min_interval_ms, asked_ms) / 1000
        now = time.monotonic()
        if interval_s and self._started_s is not None and now - self._started_s < interval_s:
            machine = self.machine
            half = machine.buffer_limit_bytes // 2
            with self._cv:
                self._cv.wait_for(
                    lambda: machine.stopping or machine.closing or machine.buffered_bytes >= half,
                    interval_s - (now - self._started_s),
                )
            now = time.monotonic()
        self._started_s = now

    def deliver_available(self) -> None:
        """Deliver everything buffered now, in batches of at most ``realtime_batch_max_events``."""
        self._paced()
        batcher, loop = self.batcher, self.loop
        if batcher is None or loop is None:
            # A new run of deliveries: a fresh consumer hears of every cache whose CREATE it reads.
            consumer, policy = self._consumer()
            loop = self.loop = DeliveryLoop(
                self, consumer, policy, retry_s=_RETRY_S, dead_letter=dead_letters.writer(policy)
            )
            batcher = self.batcher = Batcher(
                position=self.machine.position,
                caches={},
                source_node=self.node_id,
                batch_max_events=self.config.realtime_batch_max_events,
                batch_max_bytes=_NO_BYTE_BOUND,
                names=self._names,
                selected=self._selected,
            )
        batcher.restart(self.machine.position)
        for cid, info in self._caches().items():
            self._names[cid] = info.name
            if not batcher.delivers(info) and cid not in batcher.caches:  # created before what this worker read
                batcher.disabled.add(cid)
        skipped = False
        for ptr, record, done in self._records():
            before = batcher.events
            items = feed_active(batcher, ptr, record, done, 0)
            skipped |= not items and type(record) is DataRecord and batcher.events == before
            for item in items:
                # The daemon delivers from the last commit, which is before what a stop cut short;
                # a cache change is committed with the batch (or marker) after it.
                ok = self._run(loop.deliver, item) if isinstance(item, Batch) else self._run(loop.cache_change, item)
                if not ok:
                    raise Stopped
        if self.machine.stopping:
            return  # the open batch is not started: the daemon delivers it from the last commit
        if batcher.slices:
            if not self._run(loop.deliver, batcher.close()):
                raise Stopped
        elif skipped and batcher.position is not None and not loop.unconfirmed:
            # Only entries of caches with CDC off: nothing to deliver, the position moves on all the
            # same (only after data: a marker alone would make the next marker, forever).
            self.commit(batcher.position)

    def _run(self, step: Callable[[T], bool], item: T) -> bool:
        """``step(item)``; the consumer failing for good stops realtime (``Stopped``)."""
        try:
            return step(item)
        except DeliveryFailed as exc:
            log.error("realtime_consumer_failed", error=str(exc))
            self._stop("consumer_error", True)
            raise Stopped from None

    # --- the delivery loop's side (cdcd.delivery.Side) -------------------------------------------
    def call(self, what: str, fn: Callable[[], T]) -> T:
        return fn()

    def wait(self, delay_s: float, retrying: bool = False) -> bool:
        if retrying:
            metrics.RT_CONSUMER_RETRIES.inc()
        with self._cv:
            return self._cv.wait_for(lambda: self.machine.stopping, delay_s)

    def delivered(self, taken: Sequence[RecordSlice], events: EventBatch, took: int, ok: bool) -> None:
        if took:
            self.last_event_ts_ns = taken[-1].record.commit_ts_ns
            self._taken = taken[-1].pointer
            # From the oldest entry: the longest any of the batch's entries waited (pacing's wait included).
            oldest_ns = taken[0].record.commit_ts_ns
            metrics.RT_LAG_SECONDS.observe(max(0.0, (time.time_ns() - oldest_ns) / 1e9))
            metrics.RT_EVENTS.inc(took)

    def commit(self, end: WalPosition) -> None:
        """The consumer confirmed everything before ``end``: make it the position (and on the
        marker cadence have the marker thread persist it and tell the daemon)."""
        with self._cv:
            if not self.machine.confirmed(end, self._taken):
                return  # stopped while this batch ran (close timed out): the Stop record already went out
            self._committed()
        metrics.RT_COMMITTED_SEGMENT.set(end.segment)
        metrics.RT_COMMITTED_OFFSET.set(end.offset)
        metrics.RT_LAG_SEGMENTS.set(max(0, self.wal.position.segment - end.segment))
