"""JSON lines: one object per event appended to a file, fsynced before the batch is confirmed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from cdcd.config import convert
from cdcd.consumer import OP_NAMES, Consumer, EventBatch
from cdcd.wal.dump import jsonable

_WRITE_LINES = 4096


def _write_all(fd: int, lines: list[bytes]) -> None:
    lines.append(b"")
    view = memoryview(b"\n".join(lines))
    while view:
        n = os.write(fd, view)
        view = view[n:]


class JsonlOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    fsync: bool = True
    """fsync after every batch (a batch is confirmed only once it is on disk)."""


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
        decode = self._decoder.decode
        encode = self._encoder.encode
        lines: list[bytes] = []
        for s in batch.slices:
            ptr = s.pointer
            ts = s.record.commit_ts_ns
            entries = s.record.entries
            for i in range(s.start, len(entries)):
                e = entries[i]
                v = e.version
                lines.append(
                    encode(
                        {
                            "cache": batch.cache_name(e.cache_id),
                            "op": OP_NAMES[e.op],
                            "key": jsonable(decode(e.key)),
                            "value": jsonable(decode(e.value)),
                            "partition": e.partition,
                            "primary": e.primary,
                            "version": {
                                "order": v.order,
                                "node_order": v.node_order,
                                "cluster_id": v.cluster_id,
                                "topology_version": v.topology_version,
                            },
                            "commit_ts_ns": ts,
                            "pos": [ptr.segment, ptr.offset, i],
                        }
                    )
                )
                if len(lines) >= _WRITE_LINES:  # bounded memory whatever the batch size
                    _write_all(fd, lines)
                    lines = []
        if lines:
            _write_all(fd, lines)
        if self.fsync:
            os.fdatasync(fd)
        return True

    def stop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
