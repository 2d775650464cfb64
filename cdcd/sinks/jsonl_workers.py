"""The jsonl consumer's JSON encoding in worker processes that read the WAL themselves.

The daemon's process has to read and decode the whole WAL anyway (to batch, count and commit);
encoding the JSON lines there too puts both on one interpreter lock. Here worker processes do the
encoding. Only record pointers cross to a worker, never events: it re-reads those records from
the segment files in the CDC dir (the daemon keeps a segment's link until a batch after it is
committed), checks each frame's CRC and that it is the record the daemon saw (entry count,
commit time, first and last version order), and builds the lines exactly as the in-process path
does (``_Line``). The daemon tells the consumer of each batch as soon as it is cut
(``prepare_batch``), so the workers encode the next batch while one is fsynced and committed.

A batch is cut into tasks of ``_WRITE_LINES`` lines — the in-process path's write chunks — dealt
to the workers in turn (task ``seq`` to worker ``seq % n``). Each worker appends its tasks to the
output file itself (the same open file description as the consumer's), in WAL order: it may
write task ``seq`` once it holds the permission for ``seq``, which for the first task of a batch
is the coordinator's ``Go`` (sent by ``on_events``, never earlier) and for every other one comes
from the worker that has just written ``seq - 1``, through a ring of token pipes (so the order
does not wait for the daemon's interpreter lock). The file thus always holds whole tasks in
order, as with the in-process path. If a task fails for any reason (a worker died, a segment
vanished, data that cannot be encoded), nothing after it is written: the coordinator skips the
tasks after it and writes from that task on in-process, which gives the same bytes — or raises
the same error — as doing the whole batch there. Memory: each worker holds at most ``_DEPTH``
tasks (dealt, encoded or not, not yet written), and only of batches the daemon has queued. A
worker whose daemon died writes nothing more (it checks its parent before each task), so a
restarted daemon's lines never interleave with a dead one's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import msgspec
import structlog

from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.sinks.jsonl import _ENCODE_LINES, _FLAT, _Line
from cdcd.sinks.jsonl import _Version as _LineVersion
from cdcd.wal.dump import jsonable
from cdcd.wal.frame import FRAME_HEADER, FRAME_HEADER_SIZE
from cdcd.wal.records import DataRecord, Op
from cdcd.wal.segment import segment_path

log = structlog.get_logger("cdcd.sinks.jsonl")

_DEPTH = 4
"""Tasks a worker holds (dealt, not yet written): it encodes ahead while it waits for its turn to
write, and across the gap between two batches (4 x 2 workers: most of a 50k-event batch)."""
_READ_BYTES = 1 << 20
_LEN = struct.Struct("<I")
_READY_TIMEOUT_S = 60.0
_MAX_SKIP = 1024
_DATA = DataRecord.TYPE
_OP_NAMES = tuple(OP_NAMES[op] for op in Op)
"""By the op's number: the worker decodes ops as plain ints (the daemon has checked them already)."""

RecordRef = tuple[int, int, int, int, int, int, int, int]
"""(segment, offset, first entry, entry after the last, and what identifies the record the daemon
read: its entry count, commit_ts_ns and the version order of its first and last entries)."""


class _Task(msgspec.Struct, array_like=True, tag=0):
    seq: int
    last: bool
    """The batch's last task: its worker passes no permission on (the next batch's first task
    waits for its ``on_events``)."""
    names: dict[int, str]
    """Every cache name the coordinator knows of; a cache id not in it fails the task (``_Done.unknown``)."""
    records: list[RecordRef]


class _Go(msgspec.Struct, array_like=True, tag=1):
    """Permission to write the first task of a batch."""

    seq: int


class _Skip(msgspec.Struct, array_like=True, tag=2):
    """Forget task ``seq`` (never written)."""

    seq: int


class _Done(msgspec.Struct, array_like=True):
    """Task ``seq`` was appended (``written`` bytes), or not: ``error`` (nothing after it is written)."""

    seq: int
    written: int
    error: str = ""
    unknown: int | None = None
    """The cache id not in the task's names that failed it."""


_ToWorker = _Task | _Go | _Skip
_READY = -1
"""``_Done.seq`` of the message a worker sends once it is up."""
_TOKEN = struct.Struct("<q")
"""A permission passed round the ring: the seq of the task that may be written now."""


class WorkerFailed(Exception):
    """A worker died or stopped answering; the pool is unusable."""


# --- worker side ---------------------------------------------------------------------------------


class _Version(msgspec.Struct, array_like=True, gc=False):
    """A DataEntry's CacheVersion (``other_cluster_version`` is not written, so not decoded).

    Laid out exactly like the jsonl ``_Version`` (same fields, no GC): ``TaskEncoder`` turns each
    one into that class in place instead of building a copy (CPython allows ``__class__``
    assignment only between such layouts), so that it encodes as the line's JSON object.
    """

    order: int
    node_order: int
    cluster_id: int
    topology_version: int


class _FlatEntry(msgspec.Struct, array_like=True, gc=False):
    """A DataEntry whose key and value decode as ``_FLAT``: what ``jsonable`` returns unchanged."""

    cache_id: int
    op: int  # not Op: the daemon decoded this very record (CRC, count, orders) with its check
    key: _FLAT  # type: ignore[valid-type]
    value: _FLAT  # type: ignore[valid-type]
    partition: int
    version: _Version
    primary: bool = True


_BScalar = int | float | bool | None | bytes
_BFlat = _BScalar | list[_BScalar]
_FLAT_BYTES = dict[str, _BFlat] | _BFlat
"""``_FLAT`` with bytes in place of str (a union holds one str-like type): binary values, which
``jsonable`` returns unchanged too."""


class _BytesEntry(msgspec.Struct, array_like=True, gc=False):
    """A DataEntry with a ``_FLAT`` key and a ``_FLAT_BYTES`` value: what ``jsonable`` returns unchanged."""

    cache_id: int
    op: int
    key: _FLAT  # type: ignore[valid-type]
    value: _FLAT_BYTES
    partition: int
    version: _Version
    primary: bool = True


class _AnyEntry(msgspec.Struct, array_like=True, gc=False):
    cache_id: int
    op: int
    key: Any
    value: Any
    partition: int
    version: _Version
    primary: bool = True


class _FlatRecord(msgspec.Struct, array_like=True, gc=False):
    tag: int
    entries: list[_FlatEntry]
    commit_ts_ns: int


class _BytesRecord(msgspec.Struct, array_like=True, gc=False):
    tag: int
    entries: list[_BytesEntry]
    commit_ts_ns: int


class _AnyRecord(msgspec.Struct, array_like=True, gc=False):
    tag: int
    entries: list[_AnyEntry]
    commit_ts_ns: int


class _Segments:
    """Frames of the CDC dir's segment files, read through one buffer per open segment."""

    def __init__(self, cdc_dir: Path) -> None:
        self.cdc_dir = cdc_dir
        self._segment = -1
        self._fd: int | None = None
        self._buf = b""
        self._base = 0

    def _open(self, segment: int) -> int:
        self.close()
        path = segment_path(self.cdc_dir, segment)
        # As the daemon's reader: never through a symlink, never blocking on a FIFO.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        self._fd, self._segment = fd, segment
        return fd

    def payload(self, segment: int, offset: int) -> memoryview:
        """The CRC-checked payload of the DataRecord frame at ``segment:offset``."""
        fd = self._fd if segment == self._segment else None
        if fd is None:
            fd = self._open(segment)
        buf, rel = self._buf, offset - self._base
        if rel < 0 or rel + FRAME_HEADER_SIZE > len(buf):
            buf, rel = self._fill(fd, offset, FRAME_HEADER_SIZE), 0
        length, rtype, crc = FRAME_HEADER.unpack_from(buf, rel)
        end = rel + FRAME_HEADER_SIZE + length
        if end > len(buf):
            buf, rel = self._fill(fd, offset, FRAME_HEADER_SIZE + length), 0
            end = FRAME_HEADER_SIZE + length
            if end > len(buf):
                raise ValueError(f"segment {segment}: record at {offset} runs past end of file")
        payload = memoryview(buf)[rel + FRAME_HEADER_SIZE : end]
        if rtype != _DATA or zlib.crc32(payload) != crc:
            raise ValueError(f"segment {segment}: no intact DataRecord at offset {offset}")
        return payload

    def _fill(self, fd: int, offset: int, need: int) -> bytes:
        self._buf = os.pread(fd, max(_READ_BYTES, need), offset)
        self._base = offset
        return self._buf

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._segment, self._buf, self._base = None, -1, b"", 0


class _Tier:
    """A typed decoder whose results need no ``jsonable`` pass, tried until it fails; after a
    failure it is skipped for the next 2, 4, ... 1024 records."""

    __slots__ = ("backoff", "decode", "skip")

    def __init__(self, record_type: type[msgspec.Struct]) -> None:
        self.decode: Callable[[memoryview], Any] = msgspec.msgpack.Decoder(record_type).decode
        self.skip = 0
        self.backoff = 1


class UnknownCache(Exception):
    def __init__(self, cache_id: int) -> None:
        super().__init__(f"cache id {cache_id} is not among the names sent")
        self.cache_id = cache_id


class TaskEncoder:
    """A task's lines, byte for byte what ``JsonlConsumer`` writes for the same entries."""

    def __init__(self, cdc_dir: Path) -> None:
        self._tiers = [_Tier(_FlatRecord), _Tier(_BytesRecord)]
        self._decode_any = msgspec.msgpack.Decoder(_AnyRecord).decode
        self._encode_lines = msgspec.json.Encoder().encode_lines
        self._segments = _Segments(cdc_dir)

    def _record(self, payload: memoryview) -> tuple[_FlatRecord | _BytesRecord | _AnyRecord, bool]:
        """(decoded record, whether its keys and values are already what ``jsonable`` returns)."""
        for tier in self._tiers:
            if tier.skip:  # as _JsonDecoder: a failed typed attempt costs more than the general path
                tier.skip -= 1
                continue
            try:
                record = tier.decode(payload)
            except msgspec.DecodeError:
                tier.backoff = min(tier.backoff * 2, _MAX_SKIP)
                tier.skip = tier.backoff
            else:
                tier.backoff = 1
                return record, True
        return self._decode_any(payload), False

    def encode(self, task: _Task) -> bytes:
        names = task.names
        op_names = _OP_NAMES
        last_id: int | None = None
        name = ""
        line, version = _Line, _LineVersion
        encode_lines = self._encode_lines
        encoded: list[bytes] = []
        lines: list[_Line] = []
        append = lines.append
        for segment, offset, start, stop, count, ts, first, last in task.records:
            record, flat = self._record(self._segments.payload(segment, offset))
            entries = record.entries
            if (
                record.tag != _DATA
                or len(entries) != count
                or record.commit_ts_ns != ts
                or entries[0].version.order != first
                or entries[-1].version.order != last
            ):
                raise ValueError(f"segment {segment}: the record at {offset} is not the one the daemon read")
            for i in range(start, stop):
                e = entries[i]
                key, value = e.key, e.value
                if not flat:
                    if isinstance(key, (dict, list)):  # a tuple constant: `dict | list` builds a union per call
                        key = jsonable(key)
                    if isinstance(value, (dict, list)):
                        value = jsonable(value)
                cache_id = e.cache_id
                if cache_id != last_id:
                    found = names.get(cache_id)
                    if found is None:
                        raise UnknownCache(cache_id)
                    last_id, name = cache_id, found
                v: Any = e.version
                v.__class__ = version  # see _Version: a JSON object now, and no copy
                append(line(name, op_names[e.op], key, value, e.partition, e.primary, v, ts, (segment, offset, i)))
                if len(lines) >= _ENCODE_LINES:  # encoded while still in the CPU cache: a third cheaper
                    encoded.append(encode_lines(lines))
                    lines = []
                    append = lines.append
        if lines:
            encoded.append(encode_lines(lines))
        return b"".join(encoded)

    def close(self) -> None:
        self._segments.close()


class _Inbox:
    """Length-prefixed messages from a pipe."""

    def __init__(self, fd: int, decoder: msgspec.msgpack.Decoder[Any]) -> None:
        self.fd = fd
        self._decode = decoder.decode
        self._buf = bytearray()

    def _take(self) -> list[Any]:
        out = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= _LEN.size:
            (n,) = _LEN.unpack_from(buf, pos)
            if len(buf) - pos - _LEN.size < n:
                break
            out.append(self._decode(bytes(buf[pos + _LEN.size : pos + _LEN.size + n])))
            pos += _LEN.size + n
        del buf[:pos]
        return out

    def read_once(self) -> list[Any]:
        """One read (the caller knows data is there); the messages now complete. EOFError at the end."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            raise EOFError
        self._buf += data
        return self._take()

    def receive(self) -> list[Any]:
        """At least one message (blocking). EOFError once the pipe is closed."""
        out = self._take()
        while not out:
            out = self.read_once()
        return out


def _send(fd: int, msg: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(msg)
    _write_all(fd, _LEN.pack(len(body)) + body)


def _write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data)
    total = len(view)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    return total


class _Worker:
    """A worker process's loop: encode tasks as they come, append each once permitted."""

    def __init__(self, encoder: TaskEncoder, out_fd: int, token_in: int, token_out: int, *, rfd: int, wfd: int) -> None:
        self.encoder = encoder
        self.out_fd = out_fd
        self.token_in = token_in
        self.token_out = token_out
        self.wfd = wfd
        self.inbox = _Inbox(rfd, msgspec.msgpack.Decoder(_ToWorker))
        self.queue: deque[_Task] = deque()
        """Dealt, not encoded yet."""
        self.ready: dict[int, tuple[_Task, bytes | _Done]] = {}
        """Encoded (or failed to), waiting for the permission to write."""
        self.allowed: set[int] = set()
        self._tokens = bytearray()
        self.parent = os.getppid()

    def _on_message(self, msg: _Task | _Go | _Skip) -> None:
        if type(msg) is _Task:
            self.queue.append(msg)
        elif type(msg) is _Go:
            self.allowed.add(msg.seq)
        else:
            self.allowed.discard(msg.seq)
            self.ready.pop(msg.seq, None)
            self.queue = deque(t for t in self.queue if t.seq != msg.seq)

    def _on_tokens(self, data: bytes) -> None:
        self._tokens += data
        whole = len(self._tokens) - len(self._tokens) % _TOKEN.size
        for (seq,) in _TOKEN.iter_unpack(self._tokens[:whole]):
            self.allowed.add(seq)
        del self._tokens[:whole]

    def _write(self, task: _Task, result: bytes | _Done) -> None:
        if os.getppid() != self.parent:
            # The daemon died (SIGKILL): a restarted one re-delivers from its committed position,
            # and nothing of ours may land between its lines.
            raise SystemExit(0)
        if isinstance(result, _Done):
            _send(self.wfd, result)  # a failure: and the permission stops here
            return
        written = 0
        try:
            view = memoryview(result)
            while view:
                n = os.write(self.out_fd, view)
                written += n
                view = view[n:]
        except OSError as exc:
            _send(self.wfd, _Done(task.seq, written, f"{type(exc).__name__}: {exc}"))
            return
        if not task.last:
            os.write(self.token_out, _TOKEN.pack(task.seq + 1))
        _send(self.wfd, _Done(task.seq, written))

    def run(self) -> None:
        _send(self.wfd, _Done(_READY, 0))
        watch = [self.inbox.fd, self.token_in]
        while True:
            for seq in sorted(self.allowed & self.ready.keys()):
                self.allowed.discard(seq)
                self._write(*self.ready.pop(seq))
            readable, _, _ = select.select(watch, [], [], 0 if self.queue else None)
            if self.inbox.fd in readable:
                try:
                    messages = self.inbox.read_once()
                except EOFError:
                    return  # the daemon is done with us (or gone)
                for msg in messages:
                    self._on_message(msg)
            if self.token_in in readable:
                data = os.read(self.token_in, 4096)
                if data:
                    self._on_tokens(data)
                else:
                    watch.remove(self.token_in)  # the worker before us is gone: the daemon will notice
            if self.queue and not (self.allowed & self.ready.keys()):
                task = self.queue.popleft()
                try:
                    self.ready[task.seq] = (task, self.encoder.encode(task))
                except UnknownCache as exc:
                    self.ready[task.seq] = (task, _Done(task.seq, 0, str(exc), exc.cache_id))
                except Exception as exc:  # reported, and the coordinator does this task itself
                    self.ready[task.seq] = (task, _Done(task.seq, 0, f"{type(exc).__name__}: {exc}"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cdcd.sinks.jsonl_workers CDC_DIR OUT_FD TOKEN_IN_FD TOKEN_OUT_FD`` (the pool starts it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Ctrl-C and a service manager's SIGTERM reach the whole process group, but the daemon
    # finishes its batch first: it decides when workers stop (EOF on their stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    encoder = TaskEncoder(Path(args[0]))
    try:
        with contextlib.suppress(BrokenPipeError):  # the daemon is gone
            _Worker(encoder, int(args[1]), int(args[2]), int(args[3]), rfd=0, wfd=1).run()
    finally:
        encoder.close()
    return 0


# --- coordinator side ----------------------------------------------------------------------------


class _Process:
    """A worker process as the coordinator sees it: its control pipes and how many tasks it holds."""

    def __init__(self, cdc_dir: Path, out_fd: int, token_in: int, token_out: int) -> None:
        import cdcd

        env = dict(os.environ)
        root = str(Path(cdcd.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        args = [str(cdc_dir), str(out_fd), str(token_in), str(token_out)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdcd.sinks.jsonl_workers", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(out_fd, token_in, token_out),
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.wfd = self.proc.stdin.fileno()
        # Room for a few tasks of small records (~40 bytes each), so that prepare() on the daemon's
        # event loop does not wait for a busy worker to read; the default is 64 KiB.
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.wfd, fcntl.F_SETPIPE_SZ, 1 << 20)
        self.inbox = _Inbox(self.proc.stdout.fileno(), msgspec.msgpack.Decoder(_Done))
        self.pending: deque[_Done] = deque()
        self.dealt = 0
        """Tasks sent and not yet answered (or skipped)."""

    def send(self, msg: msgspec.Struct) -> None:
        try:
            _send(self.wfd, msg)
        except OSError as exc:
            raise WorkerFailed(f"jsonl worker {self.proc.pid}: {exc}") from exc

    def receive(self, timeout_s: float | None = None) -> _Done:
        if not self.pending:
            if timeout_s is not None and not select.select([self.inbox.fd], [], [], timeout_s)[0]:
                raise WorkerFailed(f"jsonl worker {self.proc.pid} not ready after {timeout_s:.0f}s")
            try:
                self.pending.extend(self.inbox.receive())
            except (EOFError, OSError) as exc:
                raise WorkerFailed(f"jsonl worker {self.proc.pid} exited ({self.proc.poll()})") from exc
        return self.pending.popleft()

    def close(self, timeout_s: float = 5.0) -> None:
        """EOF on its stdin ends it; one that does not end in time is killed."""
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.close()


class _Plan:
    """One task of a batch, its worker, and where the in-process path would resume for it."""

    __slots__ = ("batch", "entry_index", "slice_index", "task", "worker")

    def __init__(self, batch: EventBatch, task: _Task, slice_index: int, entry_index: int, worker: int) -> None:
        self.batch = batch
        self.task = task
        self.slice_index = slice_index
        self.entry_index = entry_index
        self.worker = worker


def plan_tasks(
    batch: EventBatch, lines_per_task: int, first_seq: int, workers: int, names: dict[int, str]
) -> list[_Plan]:
    """The batch cut into tasks of ``lines_per_task`` lines (the last one shorter), dealt in turn.

    ``names``: the cache names to send (the daemon does not look at every entry to find the ones
    the batch uses: a worker says when one is missing).
    """
    plans: list[_Plan] = []
    records: list[RecordRef] = []
    room = lines_per_task
    resume = (0, batch.slices[0].start) if batch.slices else (0, 0)

    def close() -> None:
        seq = first_seq + len(plans)
        plans.append(_Plan(batch, _Task(seq, False, names, records), *resume, seq % workers))

    for index, s in enumerate(batch.slices):
        record = s.record
        entries = record.entries
        n = len(entries)
        stop = n if s.stop is None else s.stop
        i = s.start
        if i >= stop:
            continue
        ptr = s.pointer
        first, last = entries[0].version.order, entries[-1].version.order
        while i < stop:
            take = min(room, stop - i)
            records.append((ptr.segment, ptr.offset, i, i + take, n, record.commit_ts_ns, first, last))
            i += take
            room -= take
            if room == 0:
                close()
                records, room, resume = [], lines_per_task, (index, i)
    if records:
        close()
    if plans:
        plans[-1].task.last = True
    return plans


def resume_slices(batch: EventBatch, slice_index: int, entry_index: int) -> list[RecordSlice]:
    """The batch's slices from entry ``entry_index`` of slice ``slice_index`` on."""
    slices = batch.slices
    if slice_index >= len(slices):
        return []
    s = slices[slice_index]
    if entry_index >= s.end:
        return list(slices[slice_index + 1 :])
    first = s if entry_index == s.start else RecordSlice(s.pointer, s.record, entry_index, s.stop)
    return [first, *slices[slice_index + 1 :]]


class _Flusher:
    """fdatasync in the background while a batch is being written, so that the consumer's own
    fdatasync at its end (the one that counts) finds less left to write.

    A failure is kept and raised by ``check``: the kernel reports a writeback error once per open
    file description, so the consumer's fdatasync on the same one may not see it again.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cdcd-jsonl-flusher", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                os.fdatasync(self.fd)
            except OSError as exc:
                if self.error is None:
                    self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()


class WorkerPool:
    """``count`` worker processes encoding for one output file descriptor.

    ``prepare`` (any thread) plans a batch that is on its way and deals its first tasks to
    workers with room, so that they encode it while the batch before is fsynced and committed;
    ``write_batch`` (the consumer's thread) lets the batch's first task be written and waits for
    all of them. A batch that was not prepared, or comes out of the order prepared, drops all
    that was prepared.
    """

    def __init__(self, count: int, cdc_dir: Path, out_fd: int, *, fsync: bool = True) -> None:
        self.cdc_dir = cdc_dir
        self.out_fd = out_fd
        self.broken: str | None = None
        self._lock = threading.RLock()
        """Guards everything below, and every send to a worker (``prepare`` runs on another thread)."""
        self._seq = 0
        self._workers: list[_Process] = []
        self._prepared: deque[EventBatch] = deque()
        self._dealt: deque[_Plan] = deque()
        """Sent to a worker, not yet answered or skipped; in order."""
        self._waiting: deque[_Plan] = deque()
        """Planned, not yet sent (the next one's worker holds ``_DEPTH`` tasks); in order."""
        self._flusher: _Flusher | None = None
        self._names: dict[int, str] = {}
        """Cache names the workers get with every task: of the first and last entries of the records
        planned so far, and any a worker found missing."""
        pipes = [os.pipe() for _ in range(count)]
        try:
            for i in range(count):
                # Worker i reads permissions from pipe i and hands them on into pipe i + 1.
                self._workers.append(_Process(cdc_dir, out_fd, pipes[i][0], pipes[(i + 1) % count][1]))
            for w in self._workers:
                if w.receive(_READY_TIMEOUT_S).seq != _READY:
                    raise WorkerFailed(f"jsonl worker {w.proc.pid}: unexpected first message")
            self._flusher = _Flusher(out_fd) if fsync else None
        except BaseException:
            self.close()
            raise
        finally:
            for r, w_ in pipes:  # only the workers hold them: a dead one's neighbour sees EOF
                os.close(r)
                os.close(w_)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def check_synced(self) -> None:
        """Raise the error of a background fdatasync, if one failed (after the consumer's own)."""
        if self._flusher is not None:
            self._flusher.check()

    def _plan(self, batch: EventBatch, lines_per_task: int) -> None:
        # The caches of each record's first and last entries: nearly always all there are, at a
        # cost per record, not per entry.
        ids = set(self._names)
        for s in batch.slices:
            entries = s.record.entries
            if entries:
                ids.add(entries[0].cache_id)
                ids.add(entries[-1].cache_id)
        # Looked up again each time: "cache-N" becomes the real name once the cache's record is read.
        self._names = {cid: batch.cache_name(cid) for cid in ids}
        plans = plan_tasks(batch, lines_per_task, self._seq, len(self._workers), self._names)
        self._seq += len(plans)
        self._waiting.extend(plans)
        self._prepared.append(batch)

    def _deal(self) -> None:
        waiting, workers = self._waiting, self._workers
        while waiting:
            w = workers[waiting[0].worker]
            if w.dealt >= _DEPTH:
                return
            plan = waiting.popleft()
            w.send(plan.task)
            w.dealt += 1
            self._dealt.append(plan)

    def _drop(self) -> None:
        """Forget every prepared batch: the workers discard what they hold of them (never written)."""
        dealt = list(self._dealt)
        self._dealt.clear()
        self._waiting.clear()
        self._prepared.clear()
        for plan in dealt:
            w = self._workers[plan.worker]
            w.dealt -= 1
            w.send(_Skip(plan.task.seq))

    def _fail(self, exc: WorkerFailed) -> None:
        """Stop every worker (so that none writes any more) and encode in-process from now on."""
        if self.broken is None:
            self.broken = str(exc)
            log.warning("jsonl_workers_failed", error=str(exc), hint="encoding in the daemon process from now on")
        self._dealt.clear()
        self._waiting.clear()
        self._prepared.clear()
        for w in self._workers:
            w.kill()
        self._workers = []

    def prepare(self, batch: EventBatch, lines_per_task: int) -> None:
        """``batch`` will (most likely) be given to ``write_batch`` after those prepared before it."""
        with self._lock:
            if self.broken is not None:
                return
            try:
                self._plan(batch, lines_per_task)
                self._deal()
            except WorkerFailed as exc:
                self._fail(exc)

    def _start(self, batch: EventBatch, lines_per_task: int) -> list[_Plan] | None:
        """Make ``batch`` the first prepared one, deal, and permit its first task; its tasks, or
        None if the pool is broken (nothing of the batch was written)."""
        with self._lock:
            if self.broken is not None:
                return None
            try:
                if self._prepared and self._prepared[0] is batch:
                    # Names were looked up when the batch was planned; the in-process path looks
                    # them up now, and a cache seen in between must not change a line.
                    planned = (p for p in chain(self._dealt, self._waiting) if p.batch is batch)
                    if any(batch.cache_name(c) != name for p in planned for c, name in p.task.names.items()):
                        self._drop()
                if not self._prepared or self._prepared[0] is not batch:
                    self._drop()
                    self._plan(batch, lines_per_task)
                self._prepared.popleft()
                self._deal()
                mine = [p for p in chain(self._dealt, self._waiting) if p.batch is batch]
                # Earlier batches are all written or dropped: the first task is dealt, at the head.
                assert mine and mine[0] is self._dealt[0]
                self._workers[mine[0].worker].send(_Go(mine[0].task.seq))
            except WorkerFailed as exc:
                self._fail(exc)
                return None
            return mine

    def write_batch(
        self, batch: EventBatch, lines_per_task: int, in_process: Callable[[list[RecordSlice]], None]
    ) -> None:
        """Append the batch's lines in WAL order; from a task that fails on, ``in_process`` does the rest.

        ``lines_per_task`` must be what the batch was prepared with.
        """
        size = os.fstat(self.out_fd).st_size
        mine = self._start(batch, lines_per_task)
        if mine is None:
            in_process(list(batch.slices))
            return
        for plan in mine:
            with self._lock:
                w = self._workers[plan.worker] if self.broken is None else None
            done: _Done | None = None
            if w is not None:
                try:
                    done = w.receive()
                    if done.seq != plan.task.seq:
                        raise WorkerFailed(f"jsonl worker {w.proc.pid} answered task {done.seq}, not {plan.task.seq}")
                except WorkerFailed as exc:
                    done = None
                    with self._lock:
                        self._fail(exc)
            if done is None:
                # The pool broke (here, or in prepare() on the daemon's loop): every worker is gone
                # now, and what they wrote after the last task answered is taken back.
                os.ftruncate(self.out_fd, size)
                in_process(resume_slices(batch, plan.slice_index, plan.entry_index))
                return
            size += done.written
            if self._flusher is not None:
                self._flusher.kick()
            with self._lock:
                if self.broken is None:
                    assert w is not None
                    self._dealt.popleft()
                    w.dealt -= 1
                    try:
                        if done.error:
                            if done.unknown is not None:  # sent with the tasks planned from now on
                                self._names[done.unknown] = batch.cache_name(done.unknown)
                            self._drop()
                        else:
                            self._deal()
                    except WorkerFailed as exc:
                        self._fail(exc)
            if done.error:
                if done.written:  # a write that failed halfway: take it back, in-process redoes it
                    size -= done.written
                    os.ftruncate(self.out_fd, size)
                log.debug("jsonl_worker_task_failed", seq=done.seq, error=done.error)
                in_process(resume_slices(batch, plan.slice_index, plan.entry_index))
                return

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.close()
            self._flusher = None
        with self._lock:
            if self.broken is None:
                self.broken = "closed"
            for w in self._workers:
                w.close()
            self._workers = []
            self._dealt.clear()
            self._waiting.clear()
            self._prepared.clear()


if __name__ == "__main__":
    sys.exit(main())
