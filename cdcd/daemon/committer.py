"""Carrying out the processor's items in order: consumer calls, state commits, link deletion.

Runs on one worker thread at a time (never concurrently with itself). Links are deleted only
after the state that no longer needs them is durable.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import structlog

from cdcd import dead_letters, failpoints, metrics
from cdcd.consumer import Consumer, DeliveryPolicy, EventBatch, RecordSlice
from cdcd.daemon.follower import delete_links_below
from cdcd.daemon.processor import Item, MarkerCommit, Switch
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.delivery import Batch, CacheChange, DeliveryFailed, DeliveryLoop
from cdcd.faults import ExitCode, Fault
from cdcd.wal.frame import count_ops
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheInfo

log = structlog.get_logger("cdcd.daemon")

_OPS = ("create", "update", "delete")
_cache_id = operator.attrgetter("cache_id")
_op = operator.attrgetter("op")
T = TypeVar("T")


class ConsumerFailed(Fault, Exception):
    """The consumer raised or reported itself dead: the daemon exits (code 4)."""

    exit_code = ExitCode.CONSUMER_FAILED


@contextlib.contextmanager
def _failing() -> Iterator[None]:
    """The delivery loop's one failure, as the daemon exits with it (code 4)."""
    try:
        yield
    except DeliveryFailed as exc:
        raise ConsumerFailed(str(exc)) from exc.__cause__


class Committer:
    def __init__(
        self,
        store: StateStore,
        state: DaemonState,
        caches: dict[int, CacheInfo],
        consumer: Consumer,
        cdc_dir: Path,
        *,
        policy: DeliveryPolicy | None = None,
        confirm_retry_s: float = 0.5,
        stopping: threading.Event | None = None,
        retrying: Callable[[], None] | None = None,
        rewind: Callable[[DaemonState], DaemonState] | None = None,
        release: Callable[[int], list[int]] | None = None,
        name: str = "default",
        primary: bool = True,
    ) -> None:
        """``retrying()`` runs at each backoff step of a consumer's ``RetriableError`` (the stall
        watch counts a retry step as progress); ``rewind(state)`` moves a state just switched to ACTIVE
        back to where the consumer's target stops holding what the node delivered (``daemon/rewind.py``).
        ``release(segment)``: this consumer needs no link below ``segment`` any more; deletes the links no
        consumer of the daemon needs and returns them (default: every link below it). ``name``: the
        consumer's (the ``consumer`` label); ``primary``: this one also feeds the unlabelled families."""
        self.store = store
        self.state = state
        self.caches = caches
        self.consumer = consumer
        self.cdc_dir = cdc_dir
        self.stopping = stopping
        """Set when the daemon stops: a consumer that takes nothing is not offered the rest again."""
        self.retrying = retrying
        self.rewind = rewind
        self.release = release or (lambda segment: delete_links_below(cdc_dir, segment))
        self.name = name
        self.primary = primary
        policy = policy or DeliveryPolicy()
        self.loop = DeliveryLoop(
            self, consumer, policy, retry_s=confirm_retry_s, dead_letter=dead_letters.writer(policy)
        )
        self._call_s = 0.0
        self._pending_caches: dict[int, CacheInfo] = {}
        self._pending_destroyed: list[int] = []
        self.events_delivered = 0
        self.last_event_ts_ns = 0
        self._taken_until = state.last_delivered
        if primary:
            metrics.DAEMON_MODE.labels(state.mode.name).set(1)
        metrics.DAEMON_CONSUMER_UP.labels(name).set(1)
        self._events_metric = metrics.DAEMON_CONSUMER_EVENTS.labels(name)

    def apply(self, item: Item) -> None:
        with _failing():
            if isinstance(item, Batch):
                self.loop.deliver(item)
            elif isinstance(item, CacheChange):
                self._cache_change(item)
            elif isinstance(item, MarkerCommit):
                self.commit(item.position)
            elif isinstance(item, Switch):
                self._switch(item)
            else:  # pragma: no cover - the processor emits nothing else
                raise TypeError(f"unknown item {item!r}")

    def check_alive(self) -> None:
        with _failing():
            self.loop.check_alive()

    def settle(self) -> None:
        """Nothing more to deliver for now: the consumer confirms what it took unconfirmed (a sink that writes
        a batch while the daemon reads the next: ``LakeOptions.write_ahead_max_s``) and the position moves."""
        with _failing():
            self.loop.settle()

    # --- the delivery loop's side (cdcd.delivery.Side) -------------------------------------------
    def call(self, what: str, fn: Callable[[], T]) -> T:
        if what == "on_events":
            self.loop.check_alive()
        t0 = time.perf_counter()
        result = fn()
        self._call_s = time.perf_counter() - t0
        return result

    def wait(self, delay_s: float, retrying: bool = False) -> bool:
        if retrying:
            if self.primary:
                metrics.DAEMON_CONSUMER_RETRIES.inc()
            if self.retrying is not None:
                self.retrying()
        if self.stopping is None:
            time.sleep(delay_s)
            return False
        return self.stopping.wait(delay_s)

    def delivered(self, taken: Sequence[RecordSlice], events: EventBatch, took: int, ok: bool) -> None:
        self.events_delivered += took
        if took:
            self.last_event_ts_ns = taken[-1].record.commit_ts_ns
            self._taken_until = taken[-1].pointer
            self._events_metric.inc(took)
        if not self.primary:
            return
        if len(events):
            metrics.DAEMON_CONSUMER_SECONDS.observe(self._call_s)
        metrics.DAEMON_BATCH_EVENTS.observe(took)
        if took:
            self._count(taken, events)
        metrics.DAEMON_BATCHES.labels("committed" if ok else "not_committed").inc()

    @property
    def unconfirmed(self) -> bool:
        """A batch returned False: nothing after the last commit may be committed until one returns True."""
        return self.loop.unconfirmed

    @staticmethod
    def _count(slices: Sequence[RecordSlice], events: EventBatch) -> None:
        # Runs for every event, so Python runs once per slice and the passes over its entries are C: the
        # ops as bytes (counted by bytes.count), the cache ids as a set; a transaction over several caches
        # (several ids) is counted pair by pair, still in C (Counter over a zip).
        counts: Counter[tuple[int, int]] = Counter()
        for s in slices:
            entries = s.record.entries
            if count_ops(entries, s.start, s.stop, counts):
                continue  # counted from the record's bytes (entries not decoded)
            if s.start or s.stop is not None:
                entries = entries[s.start : s.stop]
            ops = bytes(map(_op, entries))
            ids = set(map(_cache_id, entries))
            if len(ids) == 1:
                (cache_id,) = ids
                for op in range(len(_OPS)):
                    if n := ops.count(op):
                        counts[cache_id, op] += n
            else:
                counts.update(zip(map(_cache_id, entries), ops, strict=True))
        for (cache_id, op), n in counts.items():
            metrics.DAEMON_EVENTS.labels(events.cache_name(cache_id), _OPS[op]).inc(n)

    def announce(self, caches: list[CacheInfo]) -> None:
        """At start: tell the consumer of the caches the registry knows (retried as any cache call; a
        stop meanwhile leaves it to the next start, which announces them again)."""
        if caches:
            with _failing():
                self.loop.cache_change(CacheChange(None, created=caches))

    def _cache_change(self, item: CacheChange) -> None:
        if not self.loop.cache_change(item):
            return
        for info in item.created:
            self.caches[info.cache_id] = info
            self._pending_caches[info.cache_id] = info
            log.info("cache_seen", cache=info.name, cache_id=info.cache_id)
        for cache_id in item.destroyed:
            self.caches.pop(cache_id, None)
            self._pending_caches.pop(cache_id, None)
            self._pending_destroyed.append(cache_id)
        if item.end is None:
            return  # a batch is open: the registry change is recorded with its commit
        if self.state.mode is CdcMode.DAEMON_ACTIVE:
            self.loop.passed(item.end)  # with what the consumer holds unconfirmed, if anything, once it confirms
        elif not self.unconfirmed:
            # PASSIVE: only the node's markers move the position (links it may still need stay);
            # the registry change is recorded with the current position.
            self.commit(self.state.position)

    def _switch(self, item: Switch) -> None:
        # Everything before the switch point must be durable on the consumer side first; a daemon
        # stopped meanwhile does not switch (it reads the marker again at its next start).
        if not self.loop.confirm():
            return
        old = self.state.mode
        if item.delivered is not None and (self._taken_until is None or item.delivered > self._taken_until):
            self._taken_until = item.delivered  # the node delivered after this daemon: its record is the last
        failpoints.hit("daemon.switch.before_commit")
        self.commit(item.position if item.position is not None else self.state.position, item.mode)
        if old is not item.mode and self.primary:
            direction = "node_to_daemon" if item.mode is CdcMode.DAEMON_ACTIVE else "daemon_to_node"
            metrics.DAEMON_MODE_SWITCHES.labels(direction).inc()
            metrics.DAEMON_MODE.labels(old.name).set(0)
            metrics.DAEMON_MODE.labels(item.mode.name).set(1)
            log.info(
                "mode_switch",
                direction=direction,
                cdc_mode=item.mode.name,
                reason=item.reason,
                position=str(self.state.position) if self.state.position else None,
            )
        if item.mode is CdcMode.DAEMON_ACTIVE and self.rewind is not None:
            # What the node delivered may be gone from the target (a lake restored while it delivered):
            # the next pass starts from the target's mark, or the daemon stops with one line.
            self.state = self.rewind(self.state)

    def commit(self, position: WalPosition | None, mode: CdcMode | None = None) -> None:
        """Persist ``position`` (and mode, registry changes) durably, then delete links below it."""
        new = msgspec.structs.replace(
            self.state, position=position, mode=mode or self.state.mode, last_delivered=self._taken_until
        )
        t0 = time.perf_counter()
        self.state = self.store.commit(new, caches=self._pending_caches, destroyed=self._pending_destroyed)
        now = time.time()
        if self.primary:
            metrics.DAEMON_COMMIT_SECONDS.observe(time.perf_counter() - t0)
            metrics.DAEMON_LAST_COMMIT.set(now)
        metrics.DAEMON_CONSUMER_LAST_COMMIT.labels(self.name).set(now)
        self._pending_caches = {}
        self._pending_destroyed = []
        if mode is not None:
            failpoints.hit("daemon.switch.committed")  # state durable, links not yet deleted
        if position is not None:
            if self.primary:
                metrics.DAEMON_COMMITTED_SEGMENT.set(position.segment)
                metrics.DAEMON_COMMITTED_OFFSET.set(position.offset)
            metrics.DAEMON_CONSUMER_COMMITTED_SEGMENT.labels(self.name).set(position.segment)
            for seg in self.release(position.segment):
                metrics.DAEMON_LINKS_DELETED.inc()
                log.info("segment_done", segment=seg)
