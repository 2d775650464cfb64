"""The node's realtime worker as a state machine (IEP-104, docs/design.md §4): pure, no I/O.

Inputs are what happens: a flushed chunk offered, ``realtime on|off``, the TryStart record
durable, the daemon past it, a batch confirmed, a restore read back, close. ``next_work()`` says
what the driver (``cdcd.realtime.worker``) does next, as a frozen work item, and the driver
reports back. The driver calls every method under its one lock, so the flusher, the control
socket and the worker thread see one consistent state.

Phases: ``OFF`` (the daemon delivers), ``TRY_START`` (buffering from a TryStart record, waiting
for the daemon to pass it: the daemon still delivers), ``ON`` (the node delivers). Only ``ON``
makes the node the delivering side.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from cdcd.delivery import record_entries
from cdcd.node.metastorage import RealtimeState
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import Record
from cdcd.wal.writer import Chunk

ReadBack = list[tuple[WalPointer, Record, int]]
Source = Chunk | ReadBack
"""A buffered source: a flushed chunk (decoded lazily) or records read back from files at restore."""


class RealtimeMode(enum.Enum):
    """The realtime worker's phase (``realtime.mode`` in status and metrics)."""

    OFF = "off"
    TRY_START = "try_start"
    """Buffering from a TryStart record, waiting for the daemon to pass it."""
    ON = "on"


@dataclass(frozen=True)
class Restore:
    """Read the WAL files from ``start`` up to ``until`` (where the flushed chunks begin) into the buffer."""

    start: WalPosition
    until: WalPointer


@dataclass(frozen=True)
class Stop:
    """Stop: persist disabled, write ``StopRealtimeCdcRecord(last)``; the daemon delivers from ``last``."""

    reason: str


@dataclass(frozen=True)
class AwaitDaemon:
    """Wait until the daemon deleted the link of the TryStart's segment (None: TryStart not durable yet)."""

    try_start: WalPointer | None


@dataclass(frozen=True)
class Deliver:
    """Deliver what is buffered (``take`` gives the sources one by one)."""


@dataclass(frozen=True)
class Finish:
    """Closing and nothing left to do: the worker thread ends."""


Work = Restore | Stop | AwaitDaemon | Deliver | Finish


@dataclass(frozen=True)
class Stopped:
    """What a stop left: the phase it ended and the position the Stop record carries."""

    was: RealtimeMode
    last: WalPosition | None


class RealtimeMachine:
    def __init__(self, saved: RealtimeState, buffer_limit_bytes: int) -> None:
        self.mode = RealtimeMode.OFF
        self.saved = saved
        """The state last persisted in the metastorage."""
        self.position: WalPosition | None = saved.position
        """Everything before it is confirmed by the consumer."""
        self.try_start: WalPointer | None = saved.try_start
        self.last_delivered: WalPointer | None = saved.last_delivered
        """The last data record the consumer confirmed."""
        self.buffer_limit_bytes = buffer_limit_bytes
        self.buffer: deque[Source] = deque()
        self.buffered_bytes = 0
        self.buffer_max_used_bytes = 0
        self.overflow = False
        self.stop_reason: str | None = None
        self.closing = False
        self.deliver_from: WalPosition | None = None
        """Delivery resumes here: earlier records, and the entries of this one before its index, are done."""
        self.restore_until: WalPointer | None = None

    def persisted(self, *, enabled: bool) -> RealtimeState:
        """The state to persist now (the driver writes it, then reports nothing back)."""
        self.saved = RealtimeState(enabled, self.position, self.try_start, last_delivered=self.last_delivered)
        return self.saved

    # --- inputs -------------------------------------------------------------------------------------
    def resume(self, mode: RealtimeMode, deliver_from: WalPosition, open_position: WalPointer) -> None:
        """At open: go on in ``mode`` from ``deliver_from``; what lies before ``open_position`` is read back."""
        self.deliver_from = deliver_from
        if deliver_from.pointer < open_position:
            self.restore_until = open_position
        self.mode = mode

    def drop_pending(self, *, reason_position: WalPosition | None) -> None:
        """At open, a saved try-start or ON state without a consumer configured: forget it."""
        if reason_position is not None:
            self.position = reason_position
        self.try_start = None

    def offer(self, chunks: list[Chunk]) -> bool:
        """Queue flushed chunks; over the buffer limit the worker stops. True: the driver is woken."""
        if self.mode is RealtimeMode.OFF or self.overflow:
            return False
        for chunk in chunks:
            size = len(chunk.data)
            if self.buffered_bytes + size > self.buffer_limit_bytes:
                self.overflow = True
                self._drop_buffer()
                break
            self.buffer.append(chunk)
            self.buffered_bytes += size
        self.buffer_max_used_bytes = max(self.buffer_max_used_bytes, self.buffered_bytes)
        return True

    def begin_try_start(self) -> bool:
        """``realtime on``: from OFF, buffer from now on (records before the TryStart are skipped)."""
        if self.mode is not RealtimeMode.OFF or self.closing:
            return False
        self.overflow = False
        self.stop_reason = None
        self._drop_buffer()
        self.mode = RealtimeMode.TRY_START
        return True

    def try_start_durable(self, ptr: WalPointer) -> bool:
        """The TryStart record at ``ptr`` is durable. False: stopped meanwhile (the driver then
        writes a Stop after it, or an ACTIVE daemon would go PASSIVE for nobody)."""
        if self.mode is not RealtimeMode.TRY_START:
            return False
        self.try_start = ptr
        self.deliver_from = WalPosition(ptr.segment + 1, 0, 0)
        return True

    def daemon_passed(self) -> WalPosition:
        """The daemon committed everything before the TryStart: the node delivers from right after it."""
        assert self.try_start is not None
        self.position = WalPosition(self.try_start.segment + 1, 0, 0)
        self.try_start = None
        self.mode = RealtimeMode.ON
        return self.position

    def request_off(self, reason: str = "command") -> bool:
        """``realtime off`` (or ``cdc off``, reason ``cdc_off``): stop after the batch in flight.
        False: already off."""
        if self.mode is RealtimeMode.OFF:
            return False
        self.stop_reason = reason
        return True

    def close(self) -> None:
        self.closing = True

    def restored(self, records: ReadBack, total_bytes: int) -> None:
        self.restore_until = None
        self.buffer.appendleft(records)
        self.buffered_bytes += total_bytes

    def restore_overflowed(self) -> None:
        self.restore_until = None
        self.overflow = True

    def restore_failed(self) -> None:
        self.restore_until = None

    @property
    def stopping(self) -> bool:
        """A batch in flight is the last one: what it did not take is the daemon's."""
        return bool(self.stop_reason) or self.overflow or self.mode is not RealtimeMode.ON

    def take(self) -> tuple[Source, int] | None:
        """The next buffered source and its size, while delivering and not stopping."""
        if not self.buffer or self.overflow or self.stop_reason:
            return None
        source = self.buffer.popleft()
        size = sum(s for _, _, s in source) if isinstance(source, list) else len(source.data)
        self.buffered_bytes -= size
        return source, size

    def entries_done(self, ptr: WalPointer, record: Record) -> int | None:
        """How many entries of the record at ``ptr`` were delivered before (None: all of it, or it
        lies before the delivery start). Worker thread only."""
        start = self.deliver_from
        if start is None:
            return 0
        if ptr < start.pointer:
            return None
        self.deliver_from = None
        n = record_entries(record)
        done = start.entries_done(ptr, n)
        return None if done >= n else done

    def confirmed(self, end: WalPosition, delivered: WalPointer | None) -> bool:
        """The consumer confirmed everything before ``end``, the last data record it took at ``delivered``.
        False: stopped while the batch ran (the Stop record already went out with the earlier position)."""
        if self.mode is not RealtimeMode.ON:
            return False
        self.position = end
        if delivered is not None:
            self.last_delivered = delivered
        return True

    def stop(self) -> Stopped | None:
        """Go OFF now (the driver then persists and writes the Stop record); None: already OFF."""
        if self.mode is RealtimeMode.OFF:
            return None
        was = self.mode
        if was is RealtimeMode.TRY_START and self.try_start is not None:
            # Never delivered past the TryStart: the daemon goes on from right after it.
            self.position = WalPosition(self.try_start.segment + 1, 0, 0)
        self.try_start = None
        self._drop_buffer()
        self.overflow = False
        self.stop_reason = None
        self.deliver_from = None
        self.restore_until = None
        self.mode = RealtimeMode.OFF
        return Stopped(was, self.position)

    def _drop_buffer(self) -> None:
        self.buffer.clear()
        self.buffered_bytes = 0

    # --- output ---------------------------------------------------------------------------------------
    def next_work(self) -> Work | None:
        """What the worker thread does next; None: wait for an input."""
        if self.mode is RealtimeMode.OFF:
            self._drop_buffer()
            self.stop_reason = None
            self.overflow = False
            return Finish() if self.closing else None
        if self.restore_until is not None:
            assert self.deliver_from is not None
            return Restore(self.deliver_from, self.restore_until)
        if self.overflow:
            return Stop("overflow")
        if self.stop_reason:
            return Stop(self.stop_reason)
        if self.mode is RealtimeMode.TRY_START:
            return Stop("close_during_try_start") if self.closing else AwaitDaemon(self.try_start)
        if self.buffer:
            return Deliver()
        return Finish() if self.closing else None
