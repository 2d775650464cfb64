"""JSON lines: one object per event appended to a file, fsynced before the batch is confirmed."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from cdcd.config import check_ranges, convert
from cdcd.consumer import OP_NAMES, Consumer, EventBatch, RecordSlice
from cdcd.wal.dump import jsonable

if TYPE_CHECKING:
    from cdcd.sinks.jsonl_workers import WorkerPool

log = structlog.get_logger("cdcd.sinks.jsonl")

DEFAULT_WORKERS = 2
"""Enough to take the JSON encoding off the daemon's interpreter lock on two cores; more pay off
only with more cores (the daemon's own reading and decoding takes about one)."""

_WRITE_LINES = 4096
"""Lines written at a time: bounds memory whatever the batch size."""
_ENCODE_LINES = 256
"""Lines encoded at a time: few, so the decoded keys and values they hold do not pile up (a few
thousand live containers make the garbage collector run often, over everything else alive)."""

_Scalar = str | int | float | bool | None
_Flat = _Scalar | list[_Scalar]
_FLAT = dict[str, _Flat] | _Flat
"""What most keys and values are, and what ``jsonable`` returns unchanged (or equal): decoded as this
type they need no ``jsonable`` pass. Anything else (bytes, nested or non-str-keyed maps, ...) fails
to decode as it and takes the general path, which also raises the error of malformed data."""

_MAX_SKIP = 1024


class _JsonDecoder:
    """MessagePack to what ``jsonable(decode(raw))`` returns, the flat fast path first.

    A failed fast path costs more than the general path (msgspec builds an error), so after a
    failure it is skipped for the next 2, 4, ... 1024 values, until it works again: data that is
    rarely flat pays next to nothing for the attempts.
    """

    __slots__ = ("_backoff", "_decode", "_decode_flat", "_skip")

    def __init__(self) -> None:
        self._decode = msgspec.msgpack.Decoder().decode
        self._decode_flat = msgspec.msgpack.Decoder(_FLAT).decode
        self._skip = 0
        self._backoff = 1

    def __call__(self, raw: msgspec.Raw) -> Any:
        if self._skip:
            self._skip -= 1
        else:
            try:
                obj = self._decode_flat(raw)
            except msgspec.DecodeError:
                self._backoff = min(self._backoff * 2, _MAX_SKIP)
                self._skip = self._backoff
            else:
                self._backoff = 1
                return obj
        obj = self._decode(raw)
        # The only types jsonable() changes: scalars go through as they are. A tuple constant:
        # ``dict | list`` would build a union object on every call.
        if isinstance(obj, (dict, list)):
            obj = jsonable(obj)
        return obj


class _Version(msgspec.Struct, frozen=True, gc=False):
    """``version`` of a line; fields in output order."""

    order: int
    node_order: int
    cluster_id: int
    topology_version: int


class _Line(msgspec.Struct, frozen=True, gc=False):
    """One output line; fields in output order (encodes exactly like the dict it replaces)."""

    cache: str
    op: str
    key: Any
    value: Any
    partition: int
    primary: bool
    version: _Version
    commit_ts_ns: int
    pos: tuple[int, int, int]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class JsonlOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str
    fsync: bool = True
    """fsync after every batch (a batch is confirmed only once it is on disk)."""
    workers: int = DEFAULT_WORKERS
    """Processes that encode the lines of batches of ``2 * _WRITE_LINES`` events or more, reading
    the records again from the CDC dir (0: everything in the daemon process). Same output either
    way; each worker holds at most ``_DEPTH`` (4) tasks of ``_WRITE_LINES`` lines."""

    def __post_init__(self) -> None:
        check_ranges(self, {"workers": 0 <= self.workers <= 64})


class JsonlConsumer(Consumer):
    """Writes ``{"cache", "op", "key", "value", "partition", "primary", "version", "commit_ts_ns", "pos"}``.

    Under the daemon (which calls ``attach_cdc_dir``), batches of at least ``2 * _WRITE_LINES``
    events are encoded by ``workers`` processes that read the records from the segment files
    themselves (``cdcd.sinks.jsonl_workers``); the bytes written are the same either way.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = True, workers: int = DEFAULT_WORKERS) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.workers = workers
        self.cdc_dir: Path | None = None
        self._fd: int | None = None
        self._pool: WorkerPool | None = None
        self._encoder = msgspec.json.Encoder()
        self._decode_key = _JsonDecoder()
        self._decode_value = _JsonDecoder()

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> JsonlConsumer:
        opts = convert(options, JsonlOptions, source)
        return cls(opts.path, opts.fsync, opts.workers)

    def attach_cdc_dir(self, cdc_dir: Path) -> None:
        """Where the records of every batch can be read again (the daemon's CDC dir), before ``start``."""
        self.cdc_dir = Path(cdc_dir)

    def start(self, registry: Any = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if self.workers and self.cdc_dir is not None:
            from cdcd.sinks.jsonl_workers import WorkerFailed, WorkerPool

            try:
                self._pool = WorkerPool(self.workers, self.cdc_dir, self._fd, fsync=self.fsync)
            except (OSError, WorkerFailed) as exc:
                log.warning("jsonl_workers_unavailable", error=str(exc), hint="encoding in the daemon process")

    @property
    def worker_pids(self) -> list[int]:
        """Pids of the encoding workers (empty: everything is encoded in this process)."""
        return self._pool.pids if self._pool is not None else []

    def prepare_batch(self, batch: EventBatch) -> None:
        """The daemon's look-ahead: a batch that comes to ``on_events`` after those before it."""
        pool = self._pool
        if pool is not None and len(batch) >= 2 * _WRITE_LINES:
            pool.prepare(batch, _WRITE_LINES)

    def on_events(self, batch: EventBatch) -> bool:
        fd = self._fd
        if fd is None:
            raise RuntimeError("JsonlConsumer.on_events before start()")
        pool = self._pool
        if pool is not None and len(batch) >= 2 * _WRITE_LINES:
            pool.write_batch(batch, _WRITE_LINES, lambda slices: self._write(fd, batch, slices))
        else:
            self._write(fd, batch, batch.slices)
        if self.fsync:
            os.fdatasync(fd)
        if pool is not None:
            pool.check_synced()
            if pool.broken is not None:
                self._pool = None
                pool.close()
        return True

    def _write(self, fd: int, batch: EventBatch, slices: Sequence[RecordSlice]) -> None:
        """The lines of ``slices``, encoded here and appended in chunks of ``_WRITE_LINES``."""
        decode_key = self._decode_key
        decode_value = self._decode_value
        encode_lines = self._encoder.encode_lines
        op_names = OP_NAMES
        names: dict[int, str] = {}
        lines: list[_Line] = []
        encoded: list[bytes] = []
        unwritten = 0
        for s in slices:
            ptr = s.pointer
            segment = ptr.segment
            offset = ptr.offset
            ts = s.record.commit_ts_ns
            entries = s.record.entries
            for i in range(s.start, len(entries) if s.stop is None else s.stop):
                e = entries[i]
                cache_id = e.cache_id
                name = names.get(cache_id)
                if name is None:
                    name = names[cache_id] = batch.cache_name(cache_id)
                op = op_names[e.op]
                key = decode_key(e.key)
                value = decode_value(e.value)
                v = e.version
                lines.append(
                    _Line(
                        name,
                        op,
                        key,
                        value,
                        e.partition,
                        e.primary,
                        _Version(v.order, v.node_order, v.cluster_id, v.topology_version),
                        ts,
                        (segment, offset, i),
                    )
                )
                unwritten += 1
                if unwritten >= _WRITE_LINES:  # as before: an unencodable event writes nothing of its chunk
                    encoded.append(encode_lines(lines))
                    _write_all(fd, b"".join(encoded))
                    lines = []
                    encoded = []
                    unwritten = 0
                elif len(lines) >= _ENCODE_LINES:
                    encoded.append(encode_lines(lines))
                    lines = []
        if lines:
            encoded.append(encode_lines(lines))
        if encoded:
            _write_all(fd, b"".join(encoded))

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
