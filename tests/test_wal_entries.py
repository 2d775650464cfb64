"""The WAL reader's cheaper paths. DataRecord entries left undecoded (``LazyEntries``) and checked by the C module
(cdcd/wal/_entries.c): the check accepts exactly what msgspec's decoder accepts, counts what it decodes, and a
record read that way reads, compares and encodes as the decoded one; the segment fuzz target compares whole reads
both ways too (``tests/support/wal_fuzz.py``: ``check_lazy``). And the frames' CRC, computed in pieces."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.sinks.null import NullConsumer
from cdcd.wal import _entries
from cdcd.wal.frame import LAZY_MIN_ENTRIES, _DataRecordHead, count_ops, decode_data_record, encode_frame, frame_crc
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import CacheVersion, DataEntry, DataRecord, LazyEntries, Op

_decode = msgspec.msgpack.Decoder(tuple[DataEntry, ...]).decode
_encode = msgspec.msgpack.encode

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.integers(-40, 300),
    st.sampled_from([0, 1, 2, 3, -1, 127, 128, 255, 256, 2**15, 2**16, 2**31, 2**32, 2**63]),
)
anything: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=5), st.binary(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8,
)


def _version(depth: int) -> st.SearchStrategy[list[Any]]:
    other = st.none() if depth == 0 else st.one_of(st.none(), _version(depth - 1))
    four = st.lists(ints, min_size=4, max_size=4)
    return st.builds(lambda head, rest: [*head, *rest], four, st.lists(other, max_size=1))


def _entry() -> st.SearchStrategy[list[Any]]:
    """Entries as the node writes them, and with any field (or the count of fields) changed to anything."""
    valid = st.builds(
        lambda head, kv, partition, version, tail: [*head, *kv, partition, version, *tail],
        st.tuples(ints, st.sampled_from([0, 1, 2, 0, 1, 2, 3, -1, 255])),
        st.tuples(anything, anything),
        ints,
        _version(2),
        st.sampled_from([[], [True], [False, 5], [True, 0, "extra"], [True, 0, [1, 2]]]),
    )

    def damage(entry: list[Any], at: int, value: Any, cut: bool) -> Any:
        entry = list(entry)
        if cut:
            return entry[: at % 8]
        entry[at % len(entry)] = value
        return entry

    damaged = st.builds(damage, valid, st.integers(0, 7), anything, st.booleans())
    return st.one_of(valid, damaged, anything)


def _same_verdict(obj: Any) -> None:
    raw = _encode(obj)
    try:
        expected: int | str = len(_decode(raw))
    except (msgspec.ValidationError, msgspec.DecodeError):
        expected = "refused"
    try:
        got: int | str = _entries.check(raw)
    except ValueError:
        got = "refused"
    assert got == expected, obj


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_entry(), max_size=4))
def test_the_check_accepts_what_msgspec_decodes(entries: list[Any]) -> None:
    _same_verdict(entries)


@pytest.mark.parametrize(
    "case",
    [
        [[1, 0, 5, 6, 3, [1, 2, 3, 4, None], True, 0]],
        [[1, 0, 5, 6, 3, [1, 2, 3, 4]]],  # the fields with defaults left out
        [[1, 0, 5, 6, 3, [1, 2, 3, 4, [5, 6, 7, 8, None, "x"]], True, 0, "appended"]],
        [[1.0, 0, 5, 6, 3, [1, 2, 3, 4]]],  # a float cache id
        [[1, 3, 5, 6, 3, [1, 2, 3, 4]]],  # op out of range
        [[1, -1, 5, 6, 3, [1, 2, 3, 4]]],
        [[1, True, 5, 6, 3, [1, 2, 3, 4]]],  # a bool is no int
        [[1, 0, 5, 6, 3, [1, 2, 3]]],
        [[1, 0, 5, 6, 3, [1, 2, 3, 4, [1, 2, 3, 4, [1, 2, 3, 4]]]]],  # nested twice
        [[1, 0, 5, 6, 3, [1, 2, 3, 4, 7]]],
        [[1, 0, 5, 6, 3, [1, 2, 3, 4], 1]],  # primary as an int
        [[1, 0, 5, 6, 3, [1, 2, 3, 4], None]],
        [[1, 0, 5, 6, 3, [1, 2, 3, 4], True, None]],
        [[1, 0, 5, 6, 3]],
        [{"cache_id": 1}],
        [[1, 0, 5, 6, 3, {"order": 1}]],
        [[2**64 - 1, 0, 5, 6, -(2**63), [2**64 - 1, -5, 0, 0]]],
        [],
        {"not": "an array"},
    ],
)
def test_edges_of_the_schema(case: Any) -> None:
    _same_verdict(case)


def test_malformed_bytes_are_refused_with_the_entry() -> None:
    good = _encode([[1, 0, 5, 6, 3, [1, 2, 3, 4]], [1, 0, 5, 6, 3, [1, 2, 3, 4]]])
    for cut in range(1, len(good)):
        with pytest.raises(ValueError, match=r"truncated|not an array|fewer"):
            _entries.check(good[:cut])
    with pytest.raises(ValueError, match="trailing bytes"):
        _entries.check(good + b"\x00")
    with pytest.raises(ValueError, match=r"entry 1: op is not 0, 1 or 2"):
        _entries.check(_encode([[1, 0, 5, 6, 3, [1, 2, 3, 4]], [1, 9, 5, 6, 3, [1, 2, 3, 4]]]))
    with pytest.raises(ValueError, match=r"0xc1"):
        _entries.check(b"\x91\x96\x01\x00\xc1\x06\x03\x94\x01\x02\x03\x04")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([7, 8, -3, 2**64 - 1]), st.sampled_from([0, 1, 2])), min_size=4, max_size=30),
    st.integers(0, 35),
    st.one_of(st.none(), st.integers(0, 35)),
)
def test_count_ops_counts_the_slice(pairs: list[tuple[int, int]], start: int, stop: int | None) -> None:
    record = _record([_entry_of(cache_id, op, i) for i, (cache_id, op) in enumerate(pairs)])
    lazy = decode_data_record(_encode(record)).entries
    counts: Counter[tuple[int, int]] = Counter({(7, 0): 1})
    assert count_ops(lazy, start, stop, counts)
    assert isinstance(lazy, LazyEntries) and not lazy.decoded  # counted from the bytes
    expected = Counter({(7, 0): 1}) + Counter((e.cache_id, int(e.op)) for e in record.entries[start:stop])
    assert counts == expected
    assert not count_ops(record.entries, start, stop, counts)  # a decoded tuple: the caller counts


def _entry_of(cache_id: int, op: int, i: int) -> DataEntry:
    key, value = msgspec.Raw(_encode(i)), msgspec.Raw(_encode({"v": i}))
    return DataEntry(cache_id, Op(op), key, value, i % 4, CacheVersion(i, 1, 0, 1))


def _record(entries: list[DataEntry]) -> DataRecord:
    return DataRecord(tuple(entries), 1_700_000_000_000_000_000)


def test_lazy_entries_read_compare_and_encode_as_the_tuple() -> None:
    record = _record([_entry_of(5, i % 3, i) for i in range(20)])
    payload = _encode(record)
    lazy_record = decode_data_record(payload)
    lazy = lazy_record.entries
    assert isinstance(lazy, LazyEntries)
    assert len(lazy) == 20 and not lazy.decoded  # the count needs no decoding
    assert encode_frame(lazy_record) == encode_frame(record) and not lazy.decoded  # encoded as its bytes
    assert lazy[3] == record.entries[3] and lazy.decoded
    assert lazy[2:5] == record.entries[2:5] and list(lazy) == list(record.entries)
    assert lazy_record == record and record == lazy_record
    assert repr(lazy).startswith("(DataEntry(cache_id=5, op=<Op.CREATE: 0>")
    for entries in (lazy, record.entries):
        with pytest.raises(TypeError, match="unhashable"):
            hash(entries)  # as the tuple: its keys and values (msgspec.Raw) are not hashable
    with pytest.raises(TypeError):
        msgspec.msgpack.encode(lazy_record)  # no hook: refused, never written as something else


def test_the_head_mirrors_data_record() -> None:
    """The head decoder reads DataRecord's fields in DataRecord's order: a field appended to one and not the
    other fails here."""
    names = [f.name for f in msgspec.structs.fields(DataRecord)]
    assert names == [f.name for f in msgspec.structs.fields(_DataRecordHead)]
    assert msgspec.inspect.type_info(DataRecord).tag == msgspec.inspect.type_info(_DataRecordHead).tag  # type: ignore[attr-defined]


def test_a_daemon_leaves_entries_undecoded_only_when_no_consumer_reads_them(tmp_path: Path) -> None:
    with Node.open(tmp_path / "node") as node:
        node.cache("kv").put_all({i: {"v": i} for i in range(10)})
    config = DaemonConfig(node_dir=str(tmp_path / "node"), metrics_address="")
    alone = Daemon(config, NullConsumer(), show_progress=False)
    try:
        assert [lane.lazy_entries for lane in alone.lanes.values()] == [True]
    finally:
        alone.close()
    mixed_config = DaemonConfig(
        node_dir=str(tmp_path / "node"),
        metrics_address="",
        consumers={"a": {"kind": "null"}, "b": {"kind": "jsonl", "path": str(tmp_path / "out.jsonl")}},
        has_default_consumer=False,
    )
    mixed = Daemon(mixed_config, {"a": NullConsumer(), "b": JsonlConsumer(tmp_path / "out.jsonl")}, show_progress=False)
    try:
        assert [lane.lazy_entries for lane in mixed.lanes.values()] == [False, False]  # one read serves both
    finally:
        mixed.close()


def test_a_segment_reads_the_same_both_ways(tmp_path: Path) -> None:
    with Node.open(tmp_path / "node", archive_max_bytes=0) as node:
        cache = node.cache("kv")
        for start in range(0, 300, 30):
            cache.put_all({i: {"v": i, "s": "x" * (i % 7)} for i in range(start, start + 30)})
        cache.remove_all(list(range(0, 300, 7)))
        for i in range(3):  # transactions of fewer than LAZY_MIN_ENTRIES entries: decoded at once
            cache.put_all({1000 + j: i for j in range(i + 1)})
        node.force_archive()
    seen: set[tuple[bool, type]] = set()
    for path in sorted((tmp_path / "node" / "cdc").glob("*.wal")):
        eager = list(SegmentReader(path))
        lazy = list(SegmentReader(path, lazy_entries=True))
        kinds = {(len(r.entries) >= LAZY_MIN_ENTRIES, type(r.entries)) for _p, r in lazy if type(r) is DataRecord}
        assert kinds <= {(True, LazyEntries), (False, tuple)}
        seen |= kinds
        assert lazy == eager
    assert seen == {(True, LazyEntries), (False, tuple)}


def test_without_the_c_module_entries_are_decoded_at_once() -> None:
    code = (
        "import msgspec; from cdcd.wal.frame import decode_data_record; "
        "from tests.test_wal_entries import _record, _entry_of; "
        "r = decode_data_record(msgspec.msgpack.encode(_record([_entry_of(1, 0, i) for i in range(5)]))); "
        "print(type(r.entries).__name__)"
    )
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env={"CDCD_WAL_ENTRIES": "python", "PATH": ""}, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == "tuple"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3 * 5 * 1024 + 7), st.integers(0, 5 * 1024 + 1))
def test_the_frame_crc_is_zlibs(data: bytes, cut: int) -> None:
    """The CRC computed in pieces small enough that zlib keeps the GIL (``frame_crc``) is zlib's CRC-32 of the whole."""
    assert frame_crc(data) == zlib.crc32(data)
    assert frame_crc(memoryview(data)[cut:]) == zlib.crc32(data[cut:])
    assert frame_crc(bytearray(data)) == zlib.crc32(data)
