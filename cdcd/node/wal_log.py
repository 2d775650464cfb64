"""The node's WAL: append buffer, flusher thread (group commit), rollover and archiving."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog

from cdcd import failpoints, metrics
from cdcd.faults import ExitCode, Fault
from cdcd.node.archiver import Archiver
from cdcd.wal.errors import WalDiskFull
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import Checkpoint, Record
from cdcd.wal.segment import HEADER_SIZE
from cdcd.wal.writer import Chunk, SegmentFiles, WalWriter

log = structlog.get_logger("cdcd.node.wal")

FlushListener = Callable[[list[Chunk]], None]


class WalFailed(Fault, RuntimeError):
    """The flusher could not write the WAL; the node accepts no more writes (exit 1: a restart
    recovers from the WAL)."""

    exit_code = ExitCode.FAILED


class WalLog:
    """Thread-safe WAL appends; one flusher thread writes, fsyncs, rolls and archives.

    ``append`` returns the record's pointer and the end pointer a caller waits on with
    ``wait_durable`` (group commit: every waiter whose record is in one flush shares its fsync).
    """

    def __init__(
        self,
        *,
        work_dir: Path,
        node_id: uuid.UUID,
        position: WalPointer,
        segment_size_bytes: int,
        buffer_bytes: int,
        flush_interval_ms: int,
        force_archive_timeout_ms: int,
        archiver: Archiver,
    ) -> None:
        self._writer = WalWriter(node_id, segment_size_bytes, buffer_bytes, position)
        self._files = SegmentFiles(work_dir, self._segment_closed)
        self._archiver = archiver
        self._flush_interval_s = flush_interval_ms / 1000
        self._force_archive_timeout_s = force_archive_timeout_ms / 1000
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # flusher waits here
        self._durable_cv = threading.Condition(self._lock)  # committers and back-pressure wait here
        self._durable = position
        self._flush_requested = False
        self._roll_requested = False
        self._closing = False
        self._failure: BaseException | None = None
        self._segment_data_since: float | None = None
        self._news_segment = -1
        """Segment of the last record other than a Checkpoint (what a consumer or the daemon needs)."""
        self.flusher_pass_monotonic = time.monotonic()
        """When the flusher last woke up (it does every flush interval): a liveness signal."""
        self.appends = 0
        """Records appended since open (a checkpoint with nothing new to cover is skipped)."""
        self._listeners: list[FlushListener] = []
        self._thread = threading.Thread(target=self._run, name="cdcd-wal-flusher", daemon=True)
        metrics.WAL_SEGMENT.set(position.segment)

    def start(self) -> None:
        self._thread.start()

    @property
    def flusher_failure(self) -> BaseException | None:
        """Why the flusher thread died (None while it runs)."""
        with self._lock:
            if self._failure is None and not self._thread.is_alive() and not self._closing:
                return RuntimeError("the WAL flusher thread is not running")
            return self._failure

    @property
    def position(self) -> WalPointer:
        with self._lock:
            return self._writer.position

    @property
    def durable(self) -> WalPointer:
        with self._lock:
            return self._durable

    @property
    def last_archived(self) -> int:
        return self._archiver.last_archived

    def link_skipped(self, segment: int) -> bool:
        """True if ``segment`` was archived without a CDC link (the daemon never sees it)."""
        return segment in self._archiver.skipped_links

    def add_flush_listener(self, listener: FlushListener) -> None:
        """Called on the flusher thread with every flushed chunk, after its fsync, in WAL order."""
        self._listeners.append(listener)

    def append(self, record: Record) -> tuple[WalPointer, WalPointer]:
        """Buffer one record; returns (its pointer, the pointer to wait on for durability)."""
        with self._lock:
            offset = self._append_locked(record)
            writer = self._writer
            return WalPointer(writer._segment, offset), WalPointer(writer._segment, writer._offset)

    def append_end(self, record: Record, durable: bool) -> WalPointer | None:
        """``append`` for the write path: returns the pointer to wait on when ``durable``, else None
        (no pointer objects are built for a write nobody waits on)."""
        with self._lock:
            self._append_locked(record)
            return WalPointer(self._writer._segment, self._writer._offset) if durable else None

    def _append_locked(self, record: Record) -> int:
        if self._failure is not None:
            self._check_failed()
        writer = self._writer
        while writer._buffered >= writer.buffer_bytes:
            self._wait_for_room_locked()
        offset = writer.place(record)
        self.appends += 1
        if type(record) is not Checkpoint:
            self._news_segment = writer._segment
        if offset <= HEADER_SIZE or self._segment_data_since is None:
            # The segment's first record (fresh or just rolled), or a restart into a partly filled
            # segment: its force-archive clock starts now.
            self._segment_data_since = time.monotonic()
        return offset

    def _wait_for_room_locked(self) -> None:
        """Back-pressure: the append buffer is full, wait for the flusher to take it."""
        self._flush_requested = True
        self._wake.notify()
        self._durable_cv.wait()
        self._check_failed()

    def append_and_roll(self, record: Record) -> tuple[WalPointer, WalPointer]:
        """Append ``record`` as the last record of its segment (nothing can slip in after it)."""
        with self._lock:
            self._check_failed()
            ptr = self._writer.append_record(record)
            self.appends += 1
            self._writer.roll()
            self._segment_data_since = None
            return ptr, self._writer.position

    def wait_durable(self, end: WalPointer, timeout_s: float | None = None) -> bool:
        with self._lock:
            if self._durable >= end:
                return True
            self._flush_requested = True
            self._wake.notify()
            ok = self._durable_cv.wait_for(lambda: self._durable >= end or self._failure is not None, timeout_s)
            self._check_failed()
            return ok

    def flush(self) -> None:
        """Make everything appended so far durable."""
        with self._lock:
            end = self._writer.position
        self.wait_durable(end)

    def force_archive(self, timeout_s: float | None = None, *, only_news: bool = False) -> int | None:
        """Roll the active segment now if it holds records (``only_news``: records other than
        Checkpoints) and wait until it is archived."""
        with self._lock:
            self._check_failed()
            if not self._writer.segment_has_records:
                return None
            if only_news and self._news_segment != self._writer.segment:
                return None
            closed = self._writer.roll()
            self._segment_data_since = None
            end = self._writer.position
        self.wait_durable(end, timeout_s)
        return closed

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise WalFailed(f"WAL writes failed: {self._failure}") from self._failure

    def _segment_closed(self, segment: int, path: Path) -> None:
        self._archiver.archive(segment, path)
        log.info("segment_archived", segment=segment)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # Committers first: a dead flusher must not leave them waiting forever, whatever comes after.
            with self._lock:
                self._failure = exc
                self._durable_cv.notify_all()
            log.error("wal_flusher_failed", error=f"{type(exc).__name__}: {exc}")
            # Ended here: the node reports the failure (``cdcd node run`` exits 1 with one line), not
            # the interpreter's thread hook with a traceback.

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not (self._flush_requested or self._closing):
                    self._wake.wait(self._flush_interval_s)
                self.flusher_pass_monotonic = time.monotonic()
                writer = self._writer
                due = self._segment_data_since
                if (
                    self._force_archive_timeout_s
                    and due is not None
                    and writer.segment_has_records
                    and time.monotonic() - due >= self._force_archive_timeout_s
                ):
                    writer.roll()
                    self._segment_data_since = None
                self._flush_requested = False
                chunks = writer.take()
                end = writer.position
                closing = self._closing
            if chunks:
                failpoints.hit("wal.flush")  # tests: a flusher dying of an exception
                t0 = time.perf_counter()
                before_bytes, before_syncs = self._files.bytes_written, self._files.fsyncs
                self._write_waiting_for_space(chunks)
                metrics.WAL_FLUSH_SECONDS.observe(time.perf_counter() - t0)
                metrics.WAL_BYTES.inc(self._files.bytes_written - before_bytes)
                metrics.WAL_FSYNCS.inc(self._files.fsyncs - before_syncs)
            if chunks:
                # Before committers wake: whoever waited for durability (close() among them) then
                # knows the realtime worker has been offered everything up to that point.
                for listener in self._listeners:
                    listener(chunks)
            with self._lock:
                self._durable = end
                self._durable_cv.notify_all()
            if closing:
                self._files.close()
                return

    def _write_waiting_for_space(self, chunks: list[Chunk]) -> None:
        """Write ``chunks``; on a full disk wait for space and write the rest (committers and, once
        the buffer is full, writers wait meanwhile). Closing while the disk is full fails the WAL."""
        pending, delay_s, full_since = chunks, 0.05, 0.0
        while True:
            try:
                self._files.write(pending)
                break
            except WalDiskFull as exc:
                pending = pending[exc.done :]
                if not full_since:
                    full_since = time.monotonic()
                    metrics.WAL_DISK_FULL.set(1)
                    log.warning("wal_disk_full", error=str(exc), hint="writes resume once space is freed")
                with self._lock:
                    if self._wake.wait_for(lambda: self._closing, delay_s):
                        raise
                    self.flusher_pass_monotonic = time.monotonic()
                delay_s = min(delay_s * 2, 1.0)
        if full_since:
            metrics.WAL_DISK_FULL.set(0)
            log.info("wal_disk_space_back", waited_ms=round((time.monotonic() - full_since) * 1000))

    def close(self) -> None:
        """Flush everything and stop the flusher (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._files.close()
