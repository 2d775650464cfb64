"""The jsonl consumer's worker processes write exactly what the in-process path writes.

Records are written into real segment files, read back as the daemon would (so the batches hold
what the daemon decoded), and given to a ``JsonlConsumer`` with workers and to one without; the
files they write must be equal byte for byte, errors included. Workers are real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cdcd.sinks.jsonl as jsonl_module
from cdcd.config import ConfigError
from cdcd.consumer import EventBatch, RecordSlice
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.sinks.jsonl import JsonlConsumer, JsonlOptions
from cdcd.wal.frame import DECODERS, FRAME_HEADER_SIZE, SEGMENT_END_FRAME, encode_frame
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import NIL, CacheVersion, DataEntry, DataRecord, Op
from cdcd.wal.segment import encode_header, list_segments, segment_path
from tests.test_jsonl_sink import _UNENCODABLE, _entry

_msgpack = msgspec.msgpack.Encoder()
NAMES = {1: "orders", 2: 'a"b\\c/\u00e9\u2028\U0001f600\x00', 3: ""}


def write_segment(cdc_dir: Path, segment: int, records: list[DataRecord]) -> list[tuple[WalPointer, DataRecord]]:
    """A complete segment file holding ``records``; returns each one as the daemon's reader decodes it."""
    data = bytearray(encode_header(segment, uuid.uuid4()))
    out = []
    for record in records:
        frame = encode_frame(record)
        decoded = DECODERS[DataRecord.TYPE].decode(frame[FRAME_HEADER_SIZE:])
        assert isinstance(decoded, DataRecord)
        out.append((WalPointer(segment, len(data)), decoded))
        data += frame
    data += SEGMENT_END_FRAME
    segment_path(cdc_dir, segment).write_bytes(bytes(data))
    return out


def read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    out = bytearray()
    while chunk := os.read(fd, 1 << 20):
        out += chunk
    return bytes(out)


def run_batches(consumer: JsonlConsumer, batches: list[EventBatch], prepare: list[int]) -> str | None:
    """``prepare_batch`` for the batches listed (in that order), then ``on_events`` for all; the error, if any."""
    for i in prepare:
        consumer.prepare_batch(batches[i])
    try:
        for b in batches:
            assert consumer.on_events(b) is True
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def in_process(batches: list[EventBatch]) -> tuple[bytes, str | None]:
    fd = os.memfd_create("in-process")
    try:
        consumer = JsonlConsumer("/nonexistent/unused.jsonl", fsync=False, workers=0)
        consumer._fd = fd
        error = run_batches(consumer, batches, [])
        return read_fd(fd), error
    finally:
        os.close(fd)


class Pooled:
    """A consumer with 2 workers on one cdc dir, shared by many examples (workers start once)."""

    def __init__(self, root: Path) -> None:
        self.cdc = root / "cdc"
        self.cdc.mkdir()
        self.out = root / "out.jsonl"
        self.consumer = JsonlConsumer(self.out, fsync=True, workers=2)
        self.consumer.attach_cdc_dir(self.cdc)
        self.consumer.start()
        assert len(self.consumer.worker_pids) == 2
        self.segment = 0

    def next_segment(self) -> int:
        self.segment += 1
        return self.segment

    def run(self, batches: list[EventBatch], prepare: list[int]) -> tuple[bytes, str | None]:
        fd = self.consumer._fd
        assert fd is not None
        os.ftruncate(fd, 0)  # the workers append through the same open file description
        error = run_batches(self.consumer, batches, prepare)
        return self.out.read_bytes(), error


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pooled]:
    p = Pooled(tmp_path_factory.mktemp("pooled"))
    try:
        yield p
    finally:
        p.consumer.stop()


@contextlib.contextmanager
def write_lines(n: int) -> Iterator[None]:
    saved = jsonl_module._WRITE_LINES
    jsonl_module._WRITE_LINES = n
    try:
        yield
    finally:
        jsonl_module._WRITE_LINES = saved


@st.composite
def _batches(draw: st.DrawFn, *, bad: bool) -> tuple[list[list[DataRecord]], list[list[int]]]:
    """Batches of records and, for each record, the entry its slice starts at."""
    strategy = _entry(bad=_UNENCODABLE if bad else None)
    records, starts = [], []
    for _ in range(draw(st.integers(1, 4))):
        recs = [
            DataRecord(draw(st.lists(strategy, min_size=1, max_size=8)), draw(st.integers(0, 2**64 - 1)))
            for _ in range(draw(st.integers(1, 4)))
        ]
        records.append(recs)
        starts.append([draw(st.integers(0, len(r.entries) - 1)) if draw(st.booleans()) else 0 for r in recs])
    return records, starts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    data=st.one_of(_batches(bad=False), _batches(bad=True)),
    lines=st.sampled_from([1, 2, 3, 5]),
    prepare=st.sampled_from(["none", "all", "first", "reversed", "extra"]),
)
def test_workers_write_what_in_process_writes(
    pooled: Pooled, data: tuple[list[list[DataRecord]], list[list[int]]], lines: int, prepare: str
) -> None:
    """Random batches of any key/value shape, from entries > 0 on, prepared in order, out of order or not at all
    (and some prepared but never delivered), with unencodable values now and then, give the same bytes and the
    same error through 2 workers as in-process."""
    records, starts = data
    segment = pooled.next_segment()
    decoded = write_segment(pooled.cdc, segment, [r for recs in records for r in recs])
    batches, k = [], 0
    for recs, st_ in zip(records, starts, strict=True):
        pairs = zip(decoded[k : k + len(recs)], st_, strict=True)
        slices = [RecordSlice(ptr, rec, start) for (ptr, rec), start in pairs]
        k += len(recs)
        batches.append(EventBatch("node-a", slices, NAMES))
    order = {
        "none": [],
        "all": list(range(len(batches))),
        "first": [0],
        "reversed": list(range(len(batches)))[::-1],
    }.get(prepare, [])
    with write_lines(lines):
        expected = in_process(batches)
        if prepare == "extra":  # prepared, then the pass "ends": batches that never come
            ghost = EventBatch("node-a", [RecordSlice(ptr, rec) for ptr, rec in decoded], NAMES)
            pooled.consumer.prepare_batch(ghost)
        got = pooled.run(batches, order)
    os.unlink(segment_path(pooled.cdc, segment))
    assert got[1] == expected[1]
    assert got[0] == expected[0]
    assert len(pooled.consumer.worker_pids) == 2, "a data error is not a worker failure"


def _records(n_records: int, per_record: int, first_key: int = 0) -> list[DataRecord]:
    value = {"qty": 3, "sku": "A-7", "blob": b"\x00\xff" * 20, "nested": {"1": [1, 2]}}
    out = []
    for r in range(n_records):
        entries = [
            DataEntry(
                1 + j % 2,
                Op.DELETE if j % 7 == 6 else Op.UPDATE,
                msgspec.Raw(_msgpack.encode(first_key + r * per_record + j)),
                NIL if j % 7 == 6 else msgspec.Raw(_msgpack.encode(value if j % 3 else {"n": j})),
                j,
                CacheVersion(first_key + r * per_record + j, 1, 0, 7),
            )
            for j in range(per_record)
        ]
        out.append(DataRecord(entries, 1_000 + r))
    return out


@pytest.fixture
def small_tasks() -> Iterator[None]:
    """Tasks of 64 lines: batches of a thousand events go through the workers."""
    with write_lines(64):
        yield


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_worker_falls_back_without_a_gap_or_a_duplicate(tmp_path: Path, small_tasks: None) -> None:
    """SIGKILLing a worker between batches and in the middle of one: the batch is finished in-process (whatever
    the dead worker had written is taken back), later batches too, and the file equals the in-process one."""
    cdc = tmp_path / "cdc"
    cdc.mkdir()
    decoded = write_segment(cdc, 7, _records(60, 50))
    batches = [EventBatch("n", [RecordSlice(p, r) for p, r in decoded[i : i + 20]], NAMES) for i in (0, 20, 40)]
    expected, _ = in_process(batches)
    consumer = JsonlConsumer(tmp_path / "out.jsonl", workers=2)
    consumer.attach_cdc_dir(cdc)
    consumer.start()
    try:
        pids = consumer.worker_pids
        assert len(pids) == 2
        assert consumer.on_events(batches[0])
        consumer.prepare_batch(batches[1])
        os.kill(pids[1], signal.SIGKILL)
        assert consumer.on_events(batches[1])
        assert consumer.worker_pids == [], "a dead worker retires the pool"
        assert consumer.on_events(batches[2])
        assert not any(_alive(p) for p in pids)
    finally:
        consumer.stop()
    assert (tmp_path / "out.jsonl").read_bytes() == expected


def test_missing_segment_falls_back_to_in_process(tmp_path: Path, small_tasks: None) -> None:
    """A segment the workers cannot read any more (its link deleted) is encoded in-process from the batch in
    memory: same bytes, and the workers stay in use."""
    cdc = tmp_path / "cdc"
    cdc.mkdir()
    first = write_segment(cdc, 1, _records(10, 500))
    second = write_segment(cdc, 2, _records(10, 500, first_key=5000))
    batches = [EventBatch("n", [RecordSlice(p, r) for p, r in recs], NAMES) for recs in (first, second)]
    expected, _ = in_process(batches)
    consumer = JsonlConsumer(tmp_path / "out.jsonl", workers=2)
    consumer.attach_cdc_dir(cdc)
    consumer.start()
    try:
        consumer.prepare_batch(batches[0])
        os.unlink(segment_path(cdc, 1))
        assert consumer.on_events(batches[0])
        assert consumer.on_events(batches[1])
        assert len(consumer.worker_pids) == 2
    finally:
        consumer.stop()
    assert (tmp_path / "out.jsonl").read_bytes() == expected


def test_replaced_segment_is_not_trusted(tmp_path: Path, small_tasks: None) -> None:
    """A segment file whose records are not the ones the daemon read (same size, other content) is caught by the
    workers' checks, and the lines come from the records in memory."""
    cdc = tmp_path / "cdc"
    cdc.mkdir()
    decoded = write_segment(cdc, 3, _records(10, 500))
    batch = EventBatch("n", [RecordSlice(p, r) for p, r in decoded], NAMES)
    expected, _ = in_process([batch])
    write_segment(cdc, 3, _records(10, 500, first_key=1))  # same layout, other keys: CRCs still fine
    consumer = JsonlConsumer(tmp_path / "out.jsonl", workers=2)
    consumer.attach_cdc_dir(cdc)
    consumer.start()
    try:
        assert consumer.on_events(batch)
    finally:
        consumer.stop()
    assert (tmp_path / "out.jsonl").read_bytes() == expected


def test_workers_option_and_unattached_consumer(tmp_path: Path) -> None:
    """``workers`` is a checked option (default 2); without a CDC dir (the node's realtime worker) no process starts."""
    assert JsonlOptions(path="x").workers == 2
    with pytest.raises(ConfigError, match="key 'workers': out of range: -1"):
        JsonlConsumer.from_options({"path": "x", "workers": -1}, "test")
    consumer = JsonlConsumer.from_options({"path": str(tmp_path / "o.jsonl"), "workers": 3}, "test")
    consumer.start()
    try:
        assert consumer.worker_pids == []
    finally:
        consumer.stop()


async def _run_until(daemon: Daemon, last_segment: int) -> None:
    task = asyncio.create_task(daemon.run())
    try:
        deadline = time.monotonic() + 120
        while True:
            pos = daemon.state.position
            if pos is not None and pos.segment > last_segment:
                return
            if task.done():
                task.result()
                raise AssertionError(f"run() returned at {pos}")
            assert time.monotonic() < deadline, f"daemon stuck at {pos}"
            await asyncio.sleep(0.01)
    finally:
        daemon.stop()
        await asyncio.wait({task}, timeout=30)


def _replay(node_dir: Path, out: Path, workers: int, **config: Any) -> tuple[list[int], float]:
    """``Daemon.run()`` over the node's archived backlog (links made afresh); (worker pids, seconds)."""
    cdc = node_dir / "cdc"
    archived, _ = list_segments(node_dir / "wal" / "archive")
    for idx, path in archived.items():
        with contextlib.suppress(FileExistsError):
            os.link(path, segment_path(cdc, idx))
    shutil.rmtree(node_dir / "cdcd-state", ignore_errors=True)
    consumer = JsonlConsumer(out, workers=workers)
    daemon = Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address="", **config), consumer, show_progress=False)
    daemon.start()
    try:
        pids = consumer.worker_pids
        t0 = time.perf_counter()
        asyncio.run(_run_until(daemon, max(archived)))
        return pids, time.perf_counter() - t0
    finally:
        daemon.close()


def test_daemon_with_workers_writes_the_in_process_file(tmp_path: Path) -> None:
    """``Daemon.run()`` over a 60k-entry backlog of two caches (dict, nested and deleted values) writes the same
    file with 2 workers (prepared batches) as with none, and the workers are gone after ``close()``."""
    node_dir = tmp_path / "node"
    settings = {"wal_mode": "background", "wal_segment_size_bytes": 1 << 20, "wal_force_archive_timeout_ms": 0}
    with Node.open(node_dir, **settings) as node:
        orders, users = node.cache("orders"), node.cache("users")
        for t in range(600):
            orders.put_all({t * 100 + i: {"qty": i, "sku": f"A-{i}", "raw": b"\x01" * (i % 5)} for i in range(80)})
            users.put_all({f"u-{t}-{i}": [{1: "x"}, (t, i)] for i in range(20)})
            if t % 50 == 49:
                orders.remove_all([t * 100 + i for i in range(10)])
        node.force_archive()
    config = {"batch_max_events": 20_000, "check_interval_ms": 50}
    pids, _ = _replay(node_dir, tmp_path / "workers.jsonl", 2, **config)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids)
    _replay(node_dir, tmp_path / "in-process.jsonl", 0, **config)
    got = (tmp_path / "workers.jsonl").read_bytes()
    assert got.count(b"\n") == 600 * 100 + 12 * 10
    assert got == (tmp_path / "in-process.jsonl").read_bytes()
