"""Carrying out the processor's items in order: consumer calls, state commits, link deletion.

Runs on one worker thread at a time (never concurrently with itself). Links are deleted only
after the state that no longer needs them is durable.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path

import msgspec
import numpy as np
import structlog

from cdcd import dead_letters, failpoints, metrics
from cdcd.consumer import DEFAULT_RETRY_TIMEOUT_S, Consumer, EventBatch, RecordSlice, RefusedEvent, RetriableError
from cdcd.daemon.follower import delete_links_below
from cdcd.daemon.processor import Item, MarkerCommit, Switch
from cdcd.daemon_state import CdcMode, DaemonState, StateStore
from cdcd.dead_letters import DeadLetterError, DeadLetterFile
from cdcd.delivery import Batch, CacheChange, DeliveryLoop, EventRefused
from cdcd.faults import ExitCode, Fault
from cdcd.logging import describe
from cdcd.retry import RetriesExhausted, Retry
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheInfo

log = structlog.get_logger("cdcd.daemon")

_OPS = ("create", "update", "delete")
_cache_id = operator.attrgetter("cache_id")
_op = operator.attrgetter("op")


class ConsumerFailed(Fault, Exception):
    """The consumer raised or reported itself dead: the daemon exits (code 4)."""

    exit_code = ExitCode.CONSUMER_FAILED


class Committer:
    def __init__(
        self,
        store: StateStore,
        state: DaemonState,
        caches: dict[int, CacheInfo],
        consumer: Consumer,
        cdc_dir: Path,
        *,
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
        self.confirm_retry_s = confirm_retry_s
        self.stopping = stopping
        """Set when the daemon stops: a consumer that takes nothing is not offered the rest again."""
        self.retrying = retrying
        self.rewind = rewind
        self.release = release or (lambda segment: delete_links_below(cdc_dir, segment))
        self.name = name
        self.primary = primary
        self.retry_timeout_s = float(getattr(consumer, "retry_timeout_s", DEFAULT_RETRY_TIMEOUT_S))
        path = dead_letters.path_of(consumer)
        self.dead_letters = DeadLetterFile(path) if path else None
        self.loop = DeliveryLoop(
            self._on_events,
            self.commit,
            stopping=self._stopping,
            retry_wait=self._retry_wait,
            observe=self._observe,
            pause=self._pause,
            on_retry=self._on_retry,
            retry_timeout_s=self.retry_timeout_s,
            dead_letter=self.dead_letters.write if self.dead_letters is not None else None,
        )
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
        if isinstance(item, Batch):
            try:
                self.loop.deliver(item)
            except RetriesExhausted as exc:
                raise self._gave_up(exc) from exc.last
            except (EventRefused, DeadLetterError) as exc:
                raise ConsumerFailed(str(exc)) from exc
        elif isinstance(item, CacheChange):
            self._cache_change(item)
        elif isinstance(item, MarkerCommit):
            self.commit(item.position)
        elif isinstance(item, Switch):
            self._switch(item)
        else:  # pragma: no cover - the processor emits nothing else
            raise TypeError(f"unknown item {item!r}")

    def _call(self, what: str, fn: object, *args: object) -> object:
        try:
            return fn(*args)  # type: ignore[operator]
        except RetriableError:
            raise  # waited out by the delivery loop (batches and cache calls alike)
        except RefusedEvent as exc:
            if what == "on_events()":
                raise  # the delivery loop sets the event aside (or fails naming it)
            raise ConsumerFailed(f"consumer {what} raised {describe(exc)}") from exc
        except Exception as exc:
            raise ConsumerFailed(f"consumer {what} raised {describe(exc)}") from exc

    def _gave_up(self, exc: RetriesExhausted, what: str = "on_events()") -> ConsumerFailed:
        return ConsumerFailed(
            f"consumer {what} failing for {exc.failing_for_s:.1f} s over {exc.attempts} attempt(s) "
            f"(retry_timeout_s = {self.retry_timeout_s:g}): {describe(exc.last)}"
        )

    def _on_retry(self, retry: Retry) -> None:
        if self.primary:
            metrics.DAEMON_CONSUMER_RETRIES.inc()
        if self.retrying is not None:
            self.retrying()

    def _pause(self, delay_s: float) -> bool:
        if self.stopping is None:
            time.sleep(delay_s)
            return False
        return self.stopping.wait(delay_s)

    def check_alive(self) -> None:
        if not self._call("alive()", self.consumer.alive):
            raise ConsumerFailed("consumer reports alive() == False")

    def _on_events(self, events: EventBatch) -> bool:
        self.check_alive()
        t0 = time.perf_counter()
        ok = bool(self._call("on_events()", self.consumer.on_events, events))
        if len(events) and self.primary:
            metrics.DAEMON_CONSUMER_SECONDS.observe(time.perf_counter() - t0)
        return ok

    def _observe(self, taken: Sequence[RecordSlice], events: EventBatch, took: int, ok: bool) -> None:
        self.events_delivered += took
        if took:
            self.last_event_ts_ns = taken[-1].record.commit_ts_ns
            self._taken_until = taken[-1].pointer
            self._events_metric.inc(took)
        if not self.primary:
            return
        metrics.DAEMON_BATCH_EVENTS.observe(took)
        if took:
            self._count(taken, events)
        metrics.DAEMON_BATCHES.labels("committed" if ok else "not_committed").inc()

    def _stopping(self) -> bool:
        return self.stopping is not None and self.stopping.is_set()

    def _retry_wait(self) -> None:
        time.sleep(self.confirm_retry_s)

    @property
    def unconfirmed(self) -> bool:
        """A batch returned False: nothing after the last commit may be committed until one returns True."""
        return self.loop.unconfirmed

    @staticmethod
    def _count(slices: Sequence[RecordSlice], events: EventBatch) -> None:
        # Runs for every event: attrgetter + fromiter keep the per-event work in C, counting in numpy.
        entries = list(chain.from_iterable(s.record.entries[s.start : s.stop] for s in slices))
        n = len(entries)
        codes = np.fromiter(map(_cache_id, entries), np.int64, n) * 4 + np.fromiter(map(_op, entries), np.int64, n)
        values, counts = np.unique(codes, return_counts=True)
        for code, count in zip(values.tolist(), counts.tolist(), strict=True):
            metrics.DAEMON_EVENTS.labels(events.cache_name(code // 4), _OPS[code % 4]).inc(count)

    def _cache_call(self, what: str, fn: object, arg: object) -> bool:
        """The consumer's cache call under the delivery loop's retry policy; False: the daemon is
        stopping (the call did not succeed, nothing of it may be committed)."""
        try:
            return self.loop.cache_call(what.removesuffix("()"), lambda: self._call(what, fn, arg))
        except RetriesExhausted as exc:
            raise self._gave_up(exc, what) from exc.last

    def announce(self, caches: list[CacheInfo]) -> None:
        """At start: tell the consumer of the caches the registry knows (retried as any cache call; a
        stop meanwhile leaves it to the next start, which announces them again)."""
        if caches:
            self._cache_call("on_cache_change()", self.consumer.on_cache_change, caches)

    def _cache_change(self, item: CacheChange) -> None:
        if item.created:
            created = item.quiet or self._cache_call("on_cache_change()", self.consumer.on_cache_change, item.created)
            if not created:
                return
            for info in item.created:
                self.caches[info.cache_id] = info
                self._pending_caches[info.cache_id] = info
                log.info("cache_seen", cache=info.name, cache_id=info.cache_id)
        if item.destroyed:
            if item.drops:
                called = self._cache_call("on_cache_drop()", self.consumer.on_cache_drop, item.drops)
            else:
                called = self._cache_call("on_cache_destroy()", self.consumer.on_cache_destroy, item.destroyed)
            if not called:
                return
            for cache_id in item.destroyed:
                self.caches.pop(cache_id, None)
                self._pending_caches.pop(cache_id, None)
                self._pending_destroyed.append(cache_id)
        if item.end is None:
            return  # a batch is open: the registry change is recorded with its commit
        if not self.unconfirmed:
            # PASSIVE: only the node's markers move the position (links it may still need stay);
            # the registry change is recorded with the current position.
            self.commit(item.end if self.state.mode is CdcMode.DAEMON_ACTIVE else self.state.position)

    def _switch(self, item: Switch) -> None:
        # Everything before the switch point must be durable on the consumer side first; a daemon
        # stopped meanwhile does not switch (it reads the marker again at its next start).
        try:
            confirmed = self.loop.confirm()
        except RetriesExhausted as exc:
            raise self._gave_up(exc) from exc.last
        except EventRefused as exc:
            raise ConsumerFailed(str(exc)) from exc
        if not confirmed:
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
