"""JSON lines: one object per event appended to a file, fsynced before the batch is confirmed.

The oracle the end-to-end and crash tests check the daemon and the realtime worker against, so
it stays plain. Delivery is at least once across crashes: a batch is confirmed only once its lines
are on disk, and one that was written but not confirmed (the process died before the caller
committed its position) is written again after the restart. A process killed while writing may
leave a partial last line; the next run appends after it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from cdcd.config import convert
from cdcd.consumer import OP_NAMES, Consumer, EventBatch, RecordSlice, RetriableError
from cdcd.wal.dump import jsonable

_WRITE_LINES = 4096
"""Lines encoded and appended at a time: bounds memory whatever the batch size."""


class JsonlOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    fsync: bool = True
    """fsync after every batch (a batch is confirmed only once it is on disk)."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class JsonlConsumer(Consumer):
    """Writes ``{"cache", "op", "key", "value", "partition", "primary", "version", "commit_ts_ns", "pos"}``."""

    def __init__(self, path: str | os.PathLike[str], fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._fd: int | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> JsonlConsumer:
        opts = convert(options, JsonlOptions, source)
        return cls(opts.path, opts.fsync)

    def start(self, registry: Any = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def on_events(self, batch: EventBatch) -> bool:
        fd = self._fd
        if fd is None:
            raise RuntimeError("JsonlConsumer.on_events before start()")
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            self._write_batch(fd, batch)
        except OSError as exc:
            # A full or failing disk: cut what this attempt wrote (a retry writes it whole again),
            # then let the delivery loop wait it out.
            try:
                os.ftruncate(fd, start)
            except OSError as cut:
                raise RuntimeError(f"{self.path}: cannot cut a failed write back to {start} bytes: {cut}") from exc
            raise RetriableError(f"{self.path}: {type(exc).__name__}: {exc}") from exc
        return True

    def _write_batch(self, fd: int, batch: EventBatch) -> None:
        lines: list[dict[str, Any]] = []
        for s in batch.slices:
            for i in range(s.start, s.end):
                lines.append(self._line(batch, s, i))
                if len(lines) >= _WRITE_LINES:
                    _write_all(fd, self._encoder.encode_lines(lines))
                    lines = []
        if lines:
            _write_all(fd, self._encoder.encode_lines(lines))
        if self.fsync:
            os.fdatasync(fd)

    def _line(self, batch: EventBatch, s: RecordSlice, i: int) -> dict[str, Any]:
        e = s.record.entries[i]
        v = e.version
        return {
            "cache": batch.cache_name(e.cache_id),
            "op": OP_NAMES[e.op],
            "key": jsonable(self._decoder.decode(e.key)),
            "value": jsonable(self._decoder.decode(e.value)),
            "partition": e.partition,
            "primary": e.primary,
            "version": {
                "order": v.order,
                "node_order": v.node_order,
                "cluster_id": v.cluster_id,
                "topology_version": v.topology_version,
            },
            "commit_ts_ns": s.record.commit_ts_ns,
            "pos": [s.pointer.segment, s.pointer.offset, i],
        }

    def stop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
