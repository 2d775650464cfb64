"""Dead letters in a jsonl file: events a consumer refused for good (``RefusedEvent``), set aside by
the delivery loop for consumers that have no dead-letter destination of their own (replication,
jsonl, python classes; Kafka keeps them in ``<topic>.dlq`` itself).

One line per refused event: ``{"pos", "cache", "op", "key", "value", "error", "commit_ts_ns"}``.
Exactly once by position: the loop writes a dead letter (fsynced) before it commits the position
after it, so a crash in between offers the same event again; the file's last position then says it
is already there. Positions grow along the WAL, so the last line is all the state there is. A
process killed while writing leaves a torn last line; it was never committed and is cut at open.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from cdcd import metrics
from cdcd.consumer import CdcEvent, DeliveryPolicy
from cdcd.wal.dump import jsonable
from cdcd.wal.pointer import EventAddress

_TAIL_BYTES = 1 << 16
"""Read backwards in steps of this much to find the last line."""


def writer(policy: DeliveryPolicy) -> Callable[[CdcEvent, str], bool] | None:
    """What sets a refused event aside under ``policy``: its file's ``write``; None when the caller sets
    none aside (dead letters off: fail-fast, or kept by the consumer itself)."""
    return DeadLetterFile(policy.dead_letters_path).write if policy.dead_letters_path else None


class DeadLetterError(Exception):
    """The dead-letter file cannot be read or written; the message names it."""


class DeadLetterFile:
    """Appends refused events to ``path``; ``write`` of an event at or before the last one is a no-op.
    Dead letters are rare: the file is opened for each one, so nothing is held open between them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.last: EventAddress | None = None
        self._read = False
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DeadLetterError(f"{self.path}: cannot open the dead-letter file: {exc}") from None
        if not self._read:
            try:
                self.last = self._last_position(fd)
            except BaseException:
                os.close(fd)
                raise
            self._read = True
        return fd

    def _last_position(self, fd: int) -> EventAddress | None:
        """The position of the last whole line; a torn line after it is cut off."""
        size = os.fstat(fd).st_size
        data = b""
        start = size
        while True:  # read backwards until the last whole line is in ``data``
            cut = data.rfind(b"\n")
            head = data.rfind(b"\n", 0, cut) if cut >= 0 else -1
            if start == 0 or head >= 0:
                break
            begin = max(0, start - _TAIL_BYTES)
            data = os.pread(fd, start - begin, begin) + data
            start = begin
        if cut < 0:
            if size:
                os.ftruncate(fd, 0)  # one torn line, nothing whole
            return None
        if start + cut + 1 < size:
            os.ftruncate(fd, start + cut + 1)  # a torn line: written, never committed
        try:
            seg, off, idx = msgspec.json.decode(data[head + 1 : cut], type=dict[str, Any])["pos"]
            return EventAddress(int(seg), int(off), int(idx))
        except (msgspec.DecodeError, KeyError, ValueError, TypeError) as exc:
            raise DeadLetterError(
                f"{self.path} at offset {start + head + 1}: the last line is not a dead letter ({exc})"
            ) from None

    def write(self, event: CdcEvent, error: str) -> bool:
        """Append ``event`` (durably) unless it is already there; True if it was written."""
        fd = self._open()
        try:
            return self._write(fd, event, error)
        finally:
            os.close(fd)

    def _write(self, fd: int, event: CdcEvent, error: str) -> bool:
        pos = event.position
        if self.last is not None and pos <= self.last:
            return False
        e = event.entry
        line = self._encoder.encode(
            {
                "pos": [pos.segment, pos.offset, pos.entry_index],
                "cache": event.cache_name,
                "op": event.op_name,
                "key": jsonable(self._decoder.decode(e.key)),
                "value": jsonable(self._decoder.decode(e.value)),
                "error": error,
                "commit_ts_ns": event.commit_ts_ns,
            }
        )
        end = os.lseek(fd, 0, os.SEEK_END)
        data = memoryview(line + b"\n")
        try:
            at = end
            while data:
                n = os.pwrite(fd, data, at)
                data, at = data[n:], at + n
            os.fdatasync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)  # no torn line in the middle of the file
            raise DeadLetterError(f"{self.path}: cannot write the dead letter at {pos}: {exc}") from None
        self.last = pos
        metrics.DAEMON_DEAD_LETTERS.labels(event.cache_name).inc()
        return True
