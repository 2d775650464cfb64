"""Watching the daemon's pipeline from inside: stalls, lag, segment timings and catch-up progress.

Read by the monitor task and at scrape time (plain attributes: no lock needed). The daemon tells
it what it does (``in_thread``, ``batch_started``, ``committed``); it never delivers anything.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import structlog

from cdcd import metrics
from cdcd.consumer import EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.follower import SegmentFollower
from cdcd.daemon.sdnotify import Notifier
from cdcd.daemon_state import CdcMode, DaemonState
from cdcd.faults import ExitCode, Fault
from cdcd.wal.errors import WalError
from cdcd.wal.pointer import WalPosition
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import DataRecord
from cdcd.wal.segment import list_segments

T = TypeVar("T")
_commit_ts = operator.attrgetter("record.commit_ts_ns")
_end = operator.attrgetter("end")
_start = operator.attrgetter("start")

log = structlog.get_logger("cdcd.daemon")

PROGRESS_EVERY_S = 5.0
"""A catch-up says how far it got this often, as a log line: a "\\r" bar of its own on stdout ran into the
log lines on the same terminal."""

_TAIL_PEEK_RECORDS = 64
"""Records read from the head of the node's active segment to find its first data record."""


class PipelineStalled(Fault, Exception):
    """A consumer call or segment read ran past ``consumer_stall_timeout_ms``: the daemon exits (code 6)."""

    exit_code = ExitCode.STALLED


class Watch:
    def __init__(
        self,
        config: DaemonConfig,
        notifier: Notifier,
        state: Callable[[], DaemonState | None],
        *,
        show_progress: bool,
    ) -> None:
        """``state``: the daemon's committed state (None while it is not started)."""
        self.config = config
        self.cdc_dir = config.cdc_path
        self.notifier = notifier
        self.state = state
        self.show_progress = show_progress
        self.busy: dict[str, tuple[str, float]] = {}
        """Worker-thread call in flight per pipeline stage: (what, monotonic start)."""
        self.retrying: str | None = None
        """The consumer call that met a transient failure and retries it (None once it returned): what
        ``cdcd_daemon_consumer_state`` and ``cdcd top`` call ``retrying``."""
        self.oldest_unconfirmed_ns: int | None = None
        self.tail: tuple[int, int] | None = None
        """(segment, commit ns) of the first data record in the node's active segment, not yet in a link."""
        self.segment_started: dict[int, float] = {}
        self.stalled: str | None = None
        self._progress_total: int | None = None
        self._progress_start = 0
        self._progress_next = 0.0

    async def monitor(self) -> None:
        """WATCHDOG=1 pings while the pipeline makes progress; PipelineStalled once a worker-thread
        call (consumer or segment read) has run longer than ``consumer_stall_timeout_ms``."""
        interval = self.notifier.watchdog_interval_s
        limit_s = self.config.consumer_stall_timeout_ms / 1000
        tick = min(1.0, limit_s / 10, interval or 1.0)
        next_ping = 0.0
        while True:
            now = time.monotonic()
            for stage, (what, since) in list(self.busy.items()):
                if now - since > limit_s:
                    self.stalled = (
                        f"pipeline stalled: {what} has not returned for {now - since:.1f} s "
                        f"(consumer_stall_timeout_ms = {self.config.consumer_stall_timeout_ms}, {stage}); "
                        f"{self.segments_pending()} segment link(s) pending"
                    )
                    raise PipelineStalled(self.stalled)  # no more pings: systemd's watchdog agrees
            if interval is not None and now >= next_ping:
                self.notifier.watchdog()
                next_ping = now + interval
            await asyncio.sleep(tick)

    async def in_thread(self, stage: str, what: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread, watched by the monitor for stalls."""
        self.busy[stage] = (what, time.monotonic())
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.busy.pop(stage, None)
            if stage == "consumer":
                self.retrying = None

    def touch(self, stage: str) -> None:
        """The call in flight in ``stage`` made progress of a kind (a retry step after a transient
        error): its stall clock starts again. Called from the worker thread."""
        busy = self.busy.get(stage)
        if busy is not None:
            self.busy[stage] = (busy[0], time.monotonic())
            if stage == "consumer":
                self.retrying = busy[0]

    def read(self, chunk_first: int, chunk_last: int) -> None:
        """A read reached segments ``chunk_first..chunk_last`` (one read may span segments)."""
        now = time.monotonic()
        for segment in range(chunk_first, chunk_last + 1):
            self.segment_started.setdefault(segment, now)

    def batch_started(self, events: EventBatch) -> None:
        """A batch goes to the consumer: its oldest entry counts for the lag until confirmed."""
        slices = events.peek_slices()
        if self.oldest_unconfirmed_ns is None:
            self.oldest_unconfirmed_ns = slices[0].record.commit_ts_ns
        # Per event: commit time to now, weighted by entries per record (one numpy pass per batch;
        # map + attrgetter keep the per-record work in C).
        n = len(slices)
        ts = np.fromiter(map(_commit_ts, slices), np.int64, n)
        weights = np.fromiter(map(_end, slices), np.float64, n)
        weights -= np.fromiter(map(_start, slices), np.float64, n)
        ages = np.maximum((time.time_ns() - ts) / 1e9, 0.0)
        metrics.DAEMON_EVENT_CAPTURE_SECONDS.observe_many(ages, weights)

    def committed(self, position: WalPosition | None, *, unconfirmed: bool, follower: SegmentFollower) -> None:
        """After the consumer stage carried out an item."""
        if not unconfirmed:
            self.oldest_unconfirmed_ns = None
        if position is None:
            return
        now = time.monotonic()
        for segment in [s for s in self.segment_started if s < position.segment]:
            metrics.DAEMON_SEGMENT_CONSUMING_SECONDS.observe(now - self.segment_started.pop(segment))
        self._show(follower, position)

    def segments_pending(self) -> int:
        """Links not yet wholly consumed: from the committed position's segment on (at scrape time)."""
        state = self.state()
        if state is None:
            return 0
        pos = state.position
        found, _ = list_segments(self.cdc_dir)
        return sum(1 for s in found if pos is None or s >= pos.segment)

    def lag_seconds(self) -> float:
        """now - commit time of the oldest entry not yet confirmed: in a batch the consumer has not
        confirmed, or in the node's active segment (waiting for its roll). 0 while the node's
        realtime worker delivers (NODE_ACTIVE: its lag is on the node's endpoint)."""
        state = self.state()
        if state is None or state.mode is CdcMode.NODE_ACTIVE:
            return 0.0
        oldest = [ts for ts in (self.oldest_unconfirmed_ns,) if ts is not None]
        tail, pos = self.tail, state.position
        if tail is not None and (pos is None or tail[0] >= pos.segment):
            oldest.append(tail[1])
        return max(0.0, time.time() - min(oldest) / 1e9) if oldest else 0.0

    def peek_active_segment(self, follower: SegmentFollower) -> None:
        """Find the first data record of the node's active segment (``<node_dir>/wal``), if it is
        newer than every link: written, not yet archived, so not yet visible to the daemon."""
        self.tail = self._peek(follower)

    def _peek(self, follower: SegmentFollower) -> tuple[int, int] | None:
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

    def _show(self, follower: SegmentFollower, pos: WalPosition) -> None:
        if not self.show_progress:
            return
        if self._progress_total is None:
            found = follower.scan()
            if not found or max(found) - pos.segment <= 1:
                return
            self._progress_start = pos.segment
            self._progress_total = max(found) + 1 - pos.segment
        done = min(self._progress_total, pos.segment - self._progress_start)
        now = time.monotonic()
        if now >= self._progress_next:
            self._progress_next = now + PROGRESS_EVERY_S
            log.info("catching_up", segments_done=done, segments=self._progress_total, position=str(pos))

    def end_progress(self) -> None:
        if self.show_progress and self._progress_total:
            log.info("catch_up_ended", segments=self._progress_total)
