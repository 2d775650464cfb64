"""Realtime CDC inside the node (IEP-104, docs/design.md §4): the driver of ``RealtimeMachine``.

The flusher offers every flushed chunk (never blocking: over ``cdc_buffer_bytes`` the worker
stops and the daemon takes over). The machine (``cdcd.realtime.machine``) decides; this driver
does the I/O its work items ask for: write marker records, persist the metastorage, read back
the WAL at a restart, watch the CDC dir for the daemon passing a TryStart, call the consumer
through the shared ``DeliveryLoop``. One worker thread, woken by a condition that ``offer``,
the commands, ``close`` and file-system events of the CDC dir notify; one marker thread that
persists the position and writes ``RealtimeCdcRecord`` on the marker cadence.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from cdcd import failpoints, metrics
from cdcd.node.attach import AttachError, NodeParts
from cdcd.node.metastorage import RealtimeState
from cdcd.realtime.deliver import Deliverer, Stopped
from cdcd.realtime.links import LinkWatch
from cdcd.realtime.machine import AwaitDaemon, Deliver, Finish, RealtimeMachine, RealtimeMode, Restore, Stop, Work
from cdcd.realtime.markers import Markers
from cdcd.realtime.restore import restore_into
from cdcd.realtime.slot import ConsumerFactory, ConsumerSlot, RealtimeError
from cdcd.realtime.target import target_behind
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import StopRealtimeCdcRecord, TryStartRealtimeCdcRecord
from cdcd.wal.writer import Chunk

log = structlog.get_logger("cdcd.realtime")

OFF_ANSWER_WAIT_S = 2.0
"""``realtime off`` answers ``off`` if the consumer call in flight ends within this, else ``stopping``."""

__all__ = ["ConsumerFactory", "RealtimeError", "RealtimeMode", "RealtimeWorker"]


class RealtimeWorker:
    """The node's realtime attachment (``cdcd.node.attach.Realtime``)."""

    def __init__(self, parts: NodeParts, load_consumer: ConsumerFactory) -> None:
        self.config = parts.config
        self.wal = parts.wal
        self.node_id = parts.node_id
        self._slot = ConsumerSlot(self.config, load_consumer)
        self.buffer_limit_bytes = self.config.cdc_buffer_limit_bytes
        self.machine = RealtimeMachine(parts.metastorage.get() or RealtimeState(), self.buffer_limit_bytes)
        self._cv = threading.Condition()
        """Guards the machine; notified on every input the worker thread may be waiting for."""
        self.markers = Markers(
            self.machine,
            self._cv,
            parts.metastorage,
            self.wal,
            interval_ms=self.config.realtime_commit_record_interval_ms,
            failed=lambda: self._stop("worker_error"),
        )
        self._links = LinkWatch(self.config, self.wal, self._notify)
        self._thread: threading.Thread | None = None
        self.restored_records = 0
        self.stops: dict[str, int] = {}
        self._deliverer = Deliverer(
            self.machine,
            self._cv,
            self.config,
            self.wal,
            self.node_id,
            caches=parts.caches,
            consumer=self._slot.loaded,
            committed=self.markers.committed,
            stop=lambda reason, failed: self._stop(reason, consumer_failed=failed),
        )
        self._cdc_off = False
        """CDC links are off (``cdcd control cdc off``): nothing is captured, ``on`` is refused."""
        self._stops_done = 0
        """Stop records made durable; ``cdc_links`` waits on it (guarded by ``_cv``)."""
        self._set_mode_metric()

    @property
    def mode(self) -> RealtimeMode:
        return self.machine.mode

    @property
    def position(self) -> WalPosition | None:
        return self.machine.position

    @property
    def try_start(self) -> WalPointer | None:
        return self.machine.try_start

    @property
    def buffered_bytes(self) -> int:
        return self.machine.buffered_bytes

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # --- opening ---------------------------------------------------------------------------------
    def open(self, open_position: WalPointer) -> None:
        """Called once the WAL runs: restore an enabled state, resume a pending try-start, or start
        one if configured; otherwise write the Stop record the daemon needs to know it delivers."""
        saved, m, behind = self.machine.saved, self.machine, None
        if (saved.try_start is not None or saved.enabled) and not self.config.realtime_consumer:
            log.error("realtime_state_without_consumer", hint="realtime_consumer was removed from the config")
            ts = saved.try_start
            m.drop_pending(reason_position=WalPosition(ts.segment + 1, 0, 0) if ts is not None else None)
            self.markers.persist(enabled=False)
            saved = m.saved
        if saved.try_start is not None:
            self._slot.get()
            m.resume(RealtimeMode.TRY_START, WalPosition(saved.try_start.segment + 1, 0, 0), open_position)
            log.info("realtime_try_start_resumed", try_start=str(saved.try_start))
        elif (
            saved.enabled
            and saved.position is not None
            and not (behind := target_behind(self._slot.get(), self.node_id, saved))
        ):
            m.resume(RealtimeMode.ON, saved.position, open_position)
            log.info("realtime_restoring", position=str(saved.position))
        else:
            if behind:  # the target lost what was delivered: the daemon lands it again (realtime/target.py)
                self.wal.wait_durable(self.markers.stop_record(saved.position, behind))
                self.stops[behind] = 1
                metrics.RT_STOPS.labels(behind).inc()
            else:
                self.wal.append(StopRealtimeCdcRecord(saved.position, "node_start_realtime_off", saved.last_delivered))
            if self.config.realtime_cdc and self._cdc_off:
                log.warning("realtime_not_started", reason="cdc_off", hint="`cdcd control cdc on`, then `realtime on`")
            elif self.config.realtime_cdc:
                self.request_on()
        self._set_mode_metric()
        self._thread = threading.Thread(target=self._run, name="cdcd-realtime", daemon=True)
        self._thread.start()
        self.markers.start()

    # --- inputs from other threads -------------------------------------------------------------------
    def offer(self, chunks: list[Chunk]) -> None:
        """Flusher thread: queue flushed chunks, never block. The chunks are the writer's own buffers,
        handed over and never touched again, so they need no copy."""
        with self._cv:
            if not self.machine.offer(chunks):
                return
            self._cv.notify_all()
        metrics.RT_BUFFER_BYTES.set(self.machine.buffered_bytes)
        metrics.RT_BUFFER_MAX_USED_BYTES.set(self.machine.buffer_max_used_bytes)

    def request_on(self) -> RealtimeMode:
        """Try to start: write TryStart, roll the segment, buffer from there, wait for the daemon."""
        with self._cv:
            self._refuse_while_cdc_off()
            if self.machine.mode is not RealtimeMode.OFF or self.machine.closing:
                return self.machine.mode
        self._slot.get()
        with self._cv:
            self._refuse_while_cdc_off()  # `cdc off` may have come in while the consumer started
            if not self.machine.begin_try_start():
                return self.machine.mode
        self._set_mode_metric()
        ptr, end = self.wal.append_and_roll(TryStartRealtimeCdcRecord(time.time_ns()))
        self.wal.wait_durable(end)
        failpoints.hit("realtime.on.try_start_durable")
        with self._cv:
            accepted = self.machine.try_start_durable(ptr)
            self._cv.notify_all()
        if not accepted:
            # Stopped before the TryStart was durable: an ACTIVE daemon reading it goes PASSIVE, so
            # tell it again that the node does not deliver.
            _p, end = self.wal.append(StopRealtimeCdcRecord(self.machine.position, "try_start_aborted"))
            self.wal.wait_durable(end)
            return self.machine.mode
        self.markers.persist(enabled=False)
        failpoints.hit("realtime.on.try_start_persisted")
        log.info("realtime_try_start", try_start=str(ptr), buffer_max_bytes=self.buffer_limit_bytes)
        return RealtimeMode.TRY_START

    def _refuse_while_cdc_off(self) -> None:
        if self._cdc_off:
            raise RealtimeError(
                "realtime: CDC is off (`cdcd control cdc off`), so nothing is captured; "
                "run `cdcd control cdc on` first, then `cdcd control realtime on`"
            )

    def cdc_links(self, on: bool) -> bool:
        """The node's CDC switch. Off stops capture as Ignite's ``cdc.disabled`` does: after the batch
        in flight (delivered and committed, so the daemon does not send it again), with the Stop record
        durable before this returns, so the node can still link its segment for the daemon."""
        timeout_s = self.config.realtime_close_timeout_ms / 1000
        with self._cv:
            self._cdc_off = not on
            if on or not self.machine.request_off("cdc_off"):
                return False
            done = self._stops_done
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._stops_done > done, timeout_s):
                self._cdc_off = False
                raise RealtimeError(
                    f"cdc off: realtime capture did not stop within realtime_close_timeout_ms "
                    f"({self.config.realtime_close_timeout_ms}; a consumer call in flight), so CDC links stay on; "
                    "run `cdcd control cdc off` again once `cdcd control status` shows realtime off"
                )
        return True

    def switch(self, state: str) -> str:
        """The control command: ``on`` starts a try-start, ``off`` stops (``stopping`` while the
        consumer call in flight, a big lake write, has not returned yet)."""
        if state == "on":
            return self.request_on().value
        if state == "off":
            with self._cv:
                self.machine.request_off()
                self._cv.notify_all()
                off = self._cv.wait_for(lambda: self.machine.mode is RealtimeMode.OFF, OFF_ANSWER_WAIT_S)
            return RealtimeMode.OFF.value if off else "stopping"
        raise AttachError("realtime: state must be 'on' or 'off'")

    def request_off(self) -> RealtimeMode:
        """Stop (the consumer call in flight finishes first); returns at once."""
        with self._cv:
            self.machine.request_off()
            self._cv.notify_all()
            return self.machine.mode

    # --- the worker thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                work = self._cv.wait_for(self.machine.next_work)
                assert work is not None  # wait_for without a timeout returns a true value
            try:
                if self._do(work):
                    return
            except Stopped:
                continue
            except Exception as exc:  # never die silently: say why, fall back to the daemon
                log.error("realtime_worker_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop("worker_error")

    def _do(self, work: Work) -> bool:
        """Carry out one work item; True when the worker is done (closing)."""
        if isinstance(work, Finish):
            self._links.stop()
            return True
        if isinstance(work, Restore):
            self._restore(work)
        elif isinstance(work, Stop):
            self._stop(work.reason)
        elif isinstance(work, AwaitDaemon):
            if work.try_start is not None and self._links.daemon_passed(work.try_start):
                self._switch_on()
            else:
                self._links.start()  # file-system events of the CDC dir wake us; a slow recheck covers missed ones
                with self._cv:
                    self._cv.wait(LinkWatch.RECHECK_S)
        elif isinstance(work, Deliver):
            self._deliverer.deliver_available()
        return False

    def _switch_on(self) -> None:
        self._links.stop()
        with self._cv:
            position = self.machine.daemon_passed()
        self._set_mode_metric()
        failpoints.hit("realtime.on.before_enabled")
        self.markers.persist(enabled=True)
        failpoints.hit("realtime.on.enabled")
        log.info("realtime_switch", direction="daemon_to_node", position=str(position))

    def _restore(self, work: Restore) -> None:
        restored = restore_into(self.machine, self._cv, self.config, work, self.buffer_limit_bytes)
        if restored is None:
            self._stop("restore_failed")
        else:
            self.restored_records = restored

    def _stop(self, reason: str, *, consumer_failed: bool = False) -> None:
        """Stop: persist disabled, write Stop(last), drop the buffer. The daemon delivers from ``last``."""
        with self._cv:
            stopped = self.machine.stop()
            self._cv.notify_all()
        if stopped is None:
            return
        self._links.stop()
        self._deliverer.stopped()
        self._set_mode_metric()
        metrics.RT_BUFFER_BYTES.set(0)
        # After the machine went OFF no delivery still in flight commits; a marker being written
        # finishes first (it is for a position before this Stop's).
        self.wal.wait_durable(self.markers.stop_record(stopped.last, reason))
        with self._cv:
            self._stops_done += 1
            self._cv.notify_all()
        failpoints.hit("realtime.off.stop_durable")
        if self.machine.closing:
            # The node is going away: roll the segment so the daemon sees the Stop now, not at next start.
            self.wal.force_archive()
        self.stops[reason] = self.stops.get(reason, 0) + 1
        metrics.RT_STOPS.labels(reason).inc()
        last = str(stopped.last) if stopped.last else None
        log.warning("realtime_switch", direction="node_to_daemon", reason=reason, was=stopped.was.value, last=last)
        if consumer_failed:
            self._slot.drop(failed=True)

    def _set_mode_metric(self) -> None:
        mode = self.machine.mode
        for m in RealtimeMode:
            metrics.RT_MODE.labels(m.value).set(1 if m is mode else 0)

    # --- closing -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain (bounded by ``realtime_close_timeout_ms``) and commit; abort a pending try-start."""
        with self._cv:
            self.machine.close()
            self._cv.notify_all()
        worker = self._thread
        if worker is not None:
            worker.join(self.config.realtime_close_timeout_ms / 1000)
            if worker.is_alive():
                log.error("realtime_close_timeout", buffered_bytes=self.machine.buffered_bytes)
                if self._slot.interrupt():
                    worker.join(5.0)
                self._stop("close_timeout")
        self._links.stop()
        self.markers.close()
        end = self.markers.write_marker()
        if end is not None:
            self.wal.wait_durable(end)
        if worker is not None and worker.is_alive():
            # Its call is still running: stopping the consumer under it would free what the call uses (a native
            # writer's buffers, a closed file). The Stop record hands its batch to the daemon; the process leaves it.
            log.error(
                "realtime_consumer_left_running",
                hint="a consumer call outlived realtime_close_timeout_ms and its interrupt; the daemon delivers it",
            )
            return
        self._slot.drop(failed=False)

    def status(self) -> dict[str, Any]:
        m = self.machine
        return {
            "mode": m.mode.value,
            "buffer_used_bytes": m.buffered_bytes,
            "buffer_max_bytes": self.buffer_limit_bytes,
            "buffer_max_used_bytes": m.buffer_max_used_bytes,
            "committed": str(m.position) if m.position else None,
            "try_start": str(m.try_start) if m.try_start else None,
            "restored_records": self.restored_records,
            "stops": dict(self.stops),
            "last_event_commit_ts_ns": self._deliverer.last_event_ts_ns,
        }
