"""The jsonl consumer writes exactly the bytes of its original per-event dict implementation.

``ReferenceJsonl.on_events`` below is a verbatim copy of ``JsonlConsumer.on_events`` (and its
``_write_all``) from before the msgspec-Struct / ``encode_lines`` rewrite; the rewrite must not
change a single output byte, nor what is written and raised when an event cannot be encoded.
"""

from __future__ import annotations

import json
import math
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cdcd.sinks.jsonl as jsonl_module
from cdcd.config import ConfigError
from cdcd.consumer import OP_NAMES, EventBatch, RecordSlice
from cdcd.sinks import load_consumer
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.wal.dump import jsonable
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import NIL, CacheVersion, DataEntry, DataRecord, Op

_msgpack = msgspec.msgpack.Encoder()


def _reference_write_all(fd: int, lines: list[bytes]) -> None:
    lines.append(b"")
    view = memoryview(b"\n".join(lines))
    while view:
        n = os.write(fd, view)
        view = view[n:]


class ReferenceJsonl:
    """The pre-change ``JsonlConsumer.on_events``, copied verbatim (only ``_WRITE_LINES`` is a parameter)."""

    def __init__(self, fd: int, write_lines: int = 4096) -> None:
        self._fd: int | None = fd
        self.fsync = False
        self._write_lines = write_lines
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

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
                if len(lines) >= self._write_lines:  # bounded memory whatever the batch size
                    _reference_write_all(fd, lines)
                    lines = []
        if lines:
            _reference_write_all(fd, lines)
        if self.fsync:
            os.fdatasync(fd)
        return True


# --- strategies --------------------------------------------------------------------------------

_I64 = st.integers(-(2**63), 2**64 - 1)  # everything MessagePack holds
_TEXT = st.text(max_size=12)  # any code point: quotes, backslashes, controls, non-BMP
_FLOATS = st.floats(allow_nan=True) | st.sampled_from([math.inf, -math.inf, -0.0, 1e300, 5e-324])
_DATETIMES = st.datetimes(
    min_value=datetime(1, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
) | st.just(datetime(2026, 1, 1, tzinfo=UTC) + timedelta(microseconds=1))
_SCALARS = st.one_of(st.none(), st.booleans(), _I64, _FLOATS, _TEXT, st.binary(max_size=12), _DATETIMES)
_KEY_ATOMS = st.one_of(st.none(), st.booleans(), _I64, _FLOATS, _TEXT, st.binary(max_size=8), _DATETIMES)
# Keys that jsonable() turns into the same JSON key as another one in this list (it keeps the last).
_COLLIDING_KEYS = st.sampled_from(
    [0, "0", 1, "1", -1, "-1", 1.5, "1.5", True, "true", None, "null", b"a", "YQ==", (1, "a"), '[1,"a"]', 2**64 - 1]
)
_MAP_KEYS = st.recursive(
    _KEY_ATOMS | _COLLIDING_KEYS, lambda inner: st.tuples(inner, inner) | st.tuples(inner), max_leaves=4
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_MAP_KEYS, inner, max_size=4)
        | st.dictionaries(_TEXT, inner, max_size=4)
    ),
    max_leaves=12,
)
# Flat str-keyed maps of scalars (or lists of them): the common shape, and the one the consumer
# decodes fastest; and shapes that are nearly so, with something jsonable() changes inside.
_FLAT_MAPS = st.dictionaries(
    _TEXT, st.one_of(st.none(), st.booleans(), _I64, _FLOATS, _TEXT, st.lists(_TEXT | _I64, max_size=3)), max_size=6
)
_TRICKY_MAPS = st.dictionaries(_MAP_KEYS, _SCALARS, min_size=1, max_size=4)
_NEARLY_FLAT = st.one_of(
    st.dictionaries(_TEXT, _VALUES, max_size=4),
    st.dictionaries(_COLLIDING_KEYS, _SCALARS, min_size=2, max_size=6),
    st.lists(_SCALARS | _TRICKY_MAPS | st.dictionaries(_TEXT, _TRICKY_MAPS, max_size=2), max_size=4),
    st.dictionaries(_TEXT, st.lists(_SCALARS | _TRICKY_MAPS, max_size=3), max_size=3),
)
_UNENCODABLE = st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=4)).map(_msgpack.encode)


# Malformed MessagePack: truncated, a reserved byte, trailing bytes, a truncated flat map.
_MALFORMED = st.sampled_from([b"", b"\xc1", b"\x92\x01", b"\x01\x02", b"\x81\xa1a", b"\xa3ab"])


@st.composite
def _raw(draw: st.DrawFn, *, bad: st.SearchStrategy[Any] | None) -> msgspec.Raw:
    """MessagePack of a random key or value; now and then, with ``bad``, an unencodable or malformed one."""
    if bad is not None and draw(st.integers(0, 30)) == 0:
        return msgspec.Raw(draw(bad))
    return msgspec.Raw(_msgpack.encode(draw(st.one_of(_VALUES, _FLAT_MAPS, _NEARLY_FLAT, _SCALARS))))


@st.composite
def _entry(draw: st.DrawFn, *, bad: st.SearchStrategy[Any] | None) -> DataEntry:
    op = draw(st.sampled_from(list(Op)))
    version = CacheVersion(
        draw(_I64),
        draw(st.integers(0, 2**31)),
        draw(st.integers(-5, 5)),
        draw(st.integers(0, 2**40)),
        draw(st.none() | st.builds(CacheVersion, _I64, _I64, _I64, _I64)),
    )
    return DataEntry(
        draw(st.sampled_from([1, 2, 3, 7, -4, 2**31])),
        op,
        draw(_raw(bad=bad)),
        NIL if op == Op.DELETE else draw(_raw(bad=bad)),
        draw(st.integers(0, 65535)),
        version,
        draw(st.booleans()),
        draw(st.integers(0, 2**40)),
    )


@st.composite
def _batch(draw: st.DrawFn, *, bad: st.SearchStrategy[Any] | None) -> EventBatch:
    slices = []
    for _ in range(draw(st.integers(0, 4))):
        entries = draw(st.lists(_entry(bad=bad), min_size=1, max_size=8))
        pointer = WalPointer(draw(st.integers(0, 2**40)), draw(st.integers(0, 2**31)))
        record = DataRecord(tuple(entries), draw(st.integers(0, 2**64 - 1)))
        slices.append(RecordSlice(pointer, record, draw(st.integers(0, len(entries) - 1))))
    # 1 and 2 named (one needing escapes), 3 named "" (falls back to cache-3), the rest unknown.
    names = {1: "orders", 2: 'a"b\\c/\u00e9\u2028\U0001f600\x00', 3: ""}
    return EventBatch("node-a", slices, names)


def _run(consumer: Any, fd: int, batches: list[EventBatch]) -> tuple[bytes, str | None]:
    """Feed ``batches`` in order; the bytes written to ``fd`` and the error raised, if any."""
    error = None
    try:
        for b in batches:
            assert consumer.on_events(b) is True
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    os.lseek(fd, 0, os.SEEK_SET)
    out = bytearray()
    while chunk := os.read(fd, 1 << 20):
        out += chunk
    return bytes(out), error


# --- tests -------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    batches=st.lists(_batch(bad=None), min_size=1, max_size=3)
    | st.lists(_batch(bad=_UNENCODABLE), min_size=1, max_size=2)
    | st.lists(_batch(bad=_MALFORMED), min_size=1, max_size=2),
    write_lines=st.sampled_from([1, 2, 3, 5, 4096]),
)
def test_on_events_bytes_identical_to_reference(batches: list[EventBatch], write_lines: int) -> None:
    """Random batches (any key/value shape, deletes, several caches, slices from start > 0, bad data) match the
    reference byte for byte, errors included."""
    ref_fd = os.memfd_create("ref")
    new_fd = os.memfd_create("new")
    saved = jsonl_module._WRITE_LINES
    jsonl_module._WRITE_LINES = write_lines  # same write chunks, so even a failed batch leaves the same bytes
    try:
        expected = _run(ReferenceJsonl(ref_fd, write_lines), ref_fd, batches)
        consumer = JsonlConsumer("/nonexistent/unused.jsonl", fsync=False)
        consumer._fd = new_fd
        got = _run(consumer, new_fd, batches)
    finally:
        jsonl_module._WRITE_LINES = saved
        os.close(ref_fd)
        os.close(new_fd)
    assert got[1] == expected[1]
    assert got[0] == expected[0]


def test_real_file_json_lines(tmp_path: Path) -> None:
    """Batches appended to a real fsynced file read back as one JSON object per event, in order, with their fields."""
    path = tmp_path / "sub" / "events.jsonl"
    value = {"id": 1, "seq": 2, "nested": {3: [b"\x00\xff", (4, "x")], (4, "x"): None}, "payload": "x" * 48}
    records = []
    for r in range(1000):  # 10-entry records, 10k events: several 4096-line writes per batch
        entries = [
            DataEntry(
                1 + j % 2,
                Op.DELETE if j == 9 else Op.UPDATE,
                msgspec.Raw(_msgpack.encode(r * 10 + j)),
                NIL if j == 9 else msgspec.Raw(_msgpack.encode(value)),
                j,
                CacheVersion(r * 10 + j, 1, 0, 7),
            )
            for j in range(10)
        ]
        records.append(RecordSlice(WalPointer(5, 100 * r), DataRecord(tuple(entries), 1_000 + r), 3 if r == 0 else 0))
    consumer = JsonlConsumer(path)
    with pytest.raises(RuntimeError, match=r"on_events before start\(\)"):
        consumer.on_events(EventBatch("n", records[:1], {}))
    consumer.start()
    try:
        assert consumer.on_events(EventBatch("n", records[:600], {1: "orders"}))
        assert consumer.on_events(EventBatch("n", records[600:], {1: "orders"}))
    finally:
        consumer.stop()

    data = path.read_bytes()
    assert data.endswith(b"\n")
    lines = [json.loads(line) for line in data.split(b"\n")[:-1]]
    assert len(lines) == 10_000 - 3
    assert lines[0] == {
        "cache": "cache-2",
        "op": "update",
        "key": 3,
        "value": {"id": 1, "seq": 2, "nested": {"3": ["AP8=", [4, "x"]], '[4,"x"]': None}, "payload": "x" * 48},
        "partition": 3,
        "primary": True,
        "version": {"order": 3, "node_order": 1, "cluster_id": 0, "topology_version": 7},
        "commit_ts_ns": 1_000,
        "pos": [5, 0, 3],
    }
    assert [list(line) for line in lines[:1]] == [
        ["cache", "op", "key", "value", "partition", "primary", "version", "commit_ts_ns", "pos"]
    ]
    last = lines[-1]
    assert (last["cache"], last["op"], last["key"], last["value"], last["pos"]) == (
        "cache-2",
        "delete",
        9999,
        None,
        [5, 99_900, 9],
    )
    assert [line["key"] for line in lines] == list(range(3, 10_000))


def test_options_and_an_unknown_key(tmp_path: Path) -> None:
    """``path`` and ``fsync`` are the options; any other key is a one-line error naming it."""
    consumer = JsonlConsumer.from_options({"path": str(tmp_path / "o.jsonl"), "fsync": False}, "test")
    assert (consumer.path, consumer.fsync) == (tmp_path / "o.jsonl", False)
    with pytest.raises(ConfigError, match=r"^test: unknown key 'workers'$") as info:
        JsonlConsumer.from_options({"path": "x", "workers": 2}, "test")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^c\.toml: unknown key 'workers'$"):
        load_consumer({"kind": "jsonl", "path": "x", "workers": 0}, "c.toml")


def test_restart_appends_after_what_is_there(tmp_path: Path) -> None:
    """A restarted consumer appends (a re-delivered unconfirmed batch follows the lines, even a partial last line, of
    the run before): nothing written earlier is lost; the file is private to its owner."""
    path = tmp_path / "events.jsonl"
    entry = DataEntry(
        1, Op.UPDATE, msgspec.Raw(_msgpack.encode(1)), msgspec.Raw(_msgpack.encode("a")), 0, CacheVersion(1, 1, 0, 1)
    )
    batch = EventBatch("n", [RecordSlice(WalPointer(0, 40), DataRecord((entry, entry), 7), 0, 1)], {1: "c"})
    first = JsonlConsumer(path)
    first.start()
    assert first.on_events(batch)
    first.stop()
    assert path.stat().st_mode & 0o777 == 0o600
    with path.open("ab") as f:
        f.write(b'{"cache":"c","op"')  # a run killed in the middle of a line
    second = JsonlConsumer(path)
    second.start()
    assert second.on_events(batch)
    second.stop()
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == lines[1][len(b'{"cache":"c","op"') :]
    assert json.loads(lines[0])["pos"] == [0, 40, 0], "a slice's stop is respected: one line per run"
    assert len(lines) == 3 and lines[2] == b""
