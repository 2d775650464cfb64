"""Persisting the realtime state and writing the marker records that tell the daemon, in that
order: a marker lets the daemon delete links, so it is never ahead of the metastorage.

A thread of its own writes ``RealtimeCdcRecord`` on the marker cadence: the synced metastorage
write cost half the worker's time when done per batch, and every record flushed meanwhile waited.
On this cadence a crash re-delivers at most one interval (at-least-once; the lake drops it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from cdcd import failpoints
from cdcd.node.metastorage import Metastorage
from cdcd.node.wal_log import WalLog
from cdcd.realtime.machine import RealtimeMachine, RealtimeMode
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import RealtimeCdcRecord, StopRealtimeCdcRecord

log = structlog.get_logger("cdcd.realtime")


class Markers:
    def __init__(
        self,
        machine: RealtimeMachine,
        cv: threading.Condition,
        meta: Metastorage,
        wal: WalLog,
        *,
        interval_ms: int,
        failed: Callable[[], None],
    ) -> None:
        """``cv`` guards ``machine``; ``failed()`` stops realtime after a marker could not be written."""
        self.machine = machine
        self._cv = cv
        self.meta = meta
        self.wal = wal
        self.interval_s = interval_ms / 1000
        self._failed = failed
        self._lock = threading.Lock()
        """Held across every metastorage write and the record after it: a marker being written
        finishes before a Stop is persisted."""
        self._due = threading.Event()
        self._last = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cdcd-realtime-marker", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """A batch was confirmed (called under ``cv``): on the cadence, have the thread write a marker."""
        if time.monotonic() - self._last >= self.interval_s:
            self._last = time.monotonic()
            self._due.set()

    def persist(self, *, enabled: bool) -> None:
        """Synced LMDB write; never under ``cv`` (the flusher must not wait for it)."""
        with self._lock:
            with self._cv:
                state = self.machine.persisted(enabled=enabled)
            self.meta.put(state)

    def stop_record(self, last: WalPosition | None, reason: str) -> WalPointer:
        """After the machine went OFF: persist disabled, then write ``Stop(last)``; returns its end."""
        with self._lock:
            with self._cv:
                state = self.machine.persisted(enabled=False)
            self.meta.put(state)
            failpoints.hit("realtime.off.persisted")
            _ptr, end = self.wal.append(StopRealtimeCdcRecord(last, reason, state.last_delivered))
        return end

    def write_marker(self) -> WalPointer | None:
        """Persist the position, then write its marker; returns the marker's end (None: not ON)."""
        with self._lock:
            with self._cv:
                if self.machine.mode is not RealtimeMode.ON or self.machine.position is None:
                    return None
                state = self.machine.persisted(enabled=True)
            # Outside ``cv``: the worker commits further batches during the synced write.
            self.meta.put(state)
            assert state.position is not None
            _ptr, end = self.wal.append(RealtimeCdcRecord(state.position))
        return end

    def close(self) -> None:
        """End the thread (the caller writes the last marker itself)."""
        self._due.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self.machine.closing:
                return
            try:
                self.write_marker()
            except Exception as exc:  # never die silently: say why, fall back to the daemon
                log.error("realtime_marker_failed", error=f"{type(exc).__name__}: {exc}")
                try:
                    self._failed()
                except Exception as stop_exc:
                    log.error("realtime_stop_failed", error=f"{type(stop_exc).__name__}: {stop_exc}")
                return
