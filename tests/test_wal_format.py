"""WAL format: framing, every record type, the reader across segments, and corruption errors."""

from __future__ import annotations

import gc
import os
import uuid
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.consumer import RecordSlice
from cdcd.wal import (
    NIL,
    BadSegmentHeader,
    BadSegmentName,
    CacheConfig,
    CacheOp,
    CacheRecord,
    CacheVersion,
    Checkpoint,
    CorruptRecord,
    DataEntry,
    DataRecord,
    MissingSegment,
    Op,
    RealtimeCdcRecord,
    SegmentEnd,
    SegmentReader,
    StopRealtimeCdcRecord,
    TruncatedSegment,
    TryStartRealtimeCdcRecord,
    WalPointer,
    WalPosition,
    WalReader,
    encode_frame,
    parse_segment_name,
    segment_name,
)
from cdcd.wal.segment import HEADER_SIZE
from cdcd.wal.writer import SegmentFiles, WalWriter

enc = msgspec.msgpack.Encoder()
NODE_ID = uuid.UUID(int=7)


def entry(i: int, op: Op = Op.CREATE, value: object = "v") -> DataEntry:
    return DataEntry(
        cache_id=1,
        op=op,
        key=msgspec.Raw(enc.encode(i)),
        value=NIL if op == Op.DELETE else msgspec.Raw(enc.encode(value)),
        partition=i % 1024,
        version=CacheVersion(i, 1, 1, 1),
    )


ALL_RECORDS = [
    DataRecord((entry(1), entry(2, Op.UPDATE, {"a": [1, 2.5, None, b"x"]}), entry(3, Op.DELETE)), 123),
    CacheRecord(5, "orders", CacheOp.CREATE, CacheConfig(partitions=8, cdc_enabled=False), 9),
    CacheRecord(5, "orders", CacheOp.DESTROY),
    RealtimeCdcRecord(WalPosition(4, 100, 2)),
    StopRealtimeCdcRecord(WalPosition(4, 100, 2), "overflow"),
    StopRealtimeCdcRecord(WalPosition(4, 100, 2), "target_behind", WalPointer(3, 40)),
    StopRealtimeCdcRecord(None),
    TryStartRealtimeCdcRecord(77),
    Checkpoint(1, 2),
]


def write_log(directory: Path, records: list, segment_size: int = 4096, first_segment: int = 0) -> list[WalPointer]:
    """Write records through the real writer and flusher-side file code; close the last segment."""
    closed: list[int] = []
    writer = WalWriter(NODE_ID, segment_size, 8192, WalPointer(first_segment, 0))
    files = SegmentFiles(directory, lambda seg, path: closed.append(seg), fsync=False)
    ptrs = [writer.append_record(r) for r in records]
    writer.roll()
    chunks = writer.take()
    files.write(chunks[:-1])  # the last chunk is the next segment's header: leave no empty segment
    files.close()
    return ptrs


def read_all(directory: Path, start: WalPointer | None = None) -> list[tuple[WalPointer, object]]:
    return [(p, r) for p, r in WalReader([directory], start) if not isinstance(r, SegmentEnd)]


def test_pointer_order_and_str() -> None:
    """Pointers order by (segment, offset) and print as SEG:OFF, which parse() reads back."""
    assert WalPointer(1, 900) < WalPointer(2, 40) < WalPointer(2, 41)
    assert str(WalPointer(42, 1048576)) == "42:1048576"
    assert WalPointer.parse("42:1048576") == WalPointer(42, 1048576)
    assert str(WalPosition(3, 40, 2)) == "3:40#2"
    assert WalPosition(3, 40, 2) < WalPosition(3, 40, 3) < WalPosition(3, 41, 0)
    with pytest.raises(ValueError, match="bad WAL pointer"):
        WalPointer.parse("x:1")


def test_segment_names() -> None:
    """Segment names are exactly 16 digits + .wal; anything else is BadSegmentName."""
    assert segment_name(42) == "0000000000000042.wal"
    assert parse_segment_name("/a/b/0000000000000042.wal") == 42
    for bad in ("42.wal", "000000000000004a.wal", "0000000000000042.wal.tmp", "../0000000000000042.wal/x"):
        with pytest.raises(BadSegmentName, match="not a WAL segment name"):
            parse_segment_name(bad)


def test_round_trip_every_record_type(tmp_path: Path) -> None:
    """Every record type written through the writer reads back equal, at the pointer append() returned."""
    ptrs = write_log(tmp_path, ALL_RECORDS, segment_size=1 << 20)
    got = read_all(tmp_path)
    assert [r for _, r in got] == ALL_RECORDS
    assert [p for p, _ in got] == ptrs
    assert ptrs[0] == WalPointer(0, HEADER_SIZE)


def test_records_read_back_are_not_tracked_by_the_garbage_collector(tmp_path: Path) -> None:
    """A backlog of decoded records must not make every collection walk its entries: after one
    collection no record, entry tuple, entry or version of any record type is tracked (a list of
    entries, or a record type with gc on, would be)."""
    write_log(tmp_path, ALL_RECORDS, segment_size=1 << 20)
    got = [r for _, r in read_all(tmp_path)]
    gc.collect()
    tracked = [r for r in got if gc.is_tracked(r)]
    data = [r for r in got if isinstance(r, DataRecord)]
    tracked += [r.entries for r in data if gc.is_tracked(r.entries)]
    tracked += [e for r in data for e in r.entries if gc.is_tracked(e) or gc.is_tracked(e.version)]
    assert data and tracked == []
    assert not gc.is_tracked(RecordSlice(WalPointer(0, HEADER_SIZE), data[0]))


def test_reader_starts_at_any_pointer_across_segments(tmp_path: Path) -> None:
    """Reading from the pointer of record i yields records i.. across segment boundaries."""
    records = [DataRecord((entry(i),), i) for i in range(300)]
    ptrs = write_log(tmp_path, records, segment_size=2048)
    assert len({p.segment for p in ptrs}) >= 5
    for i in (0, 1, 37, 150, 299):
        assert [r for _, r in read_all(tmp_path, ptrs[i])] == records[i:]


settings.register_profile("ci", max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("ci")

keys = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=30)
    ),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=10,
)
transactions = st.lists(
    st.lists(st.tuples(keys, st.sampled_from([Op.CREATE, Op.UPDATE, Op.DELETE]), values), min_size=1, max_size=8),
    min_size=1,
    max_size=120,
)


@given(transactions, st.integers(min_value=4096, max_value=16384))
def test_any_transactions_read_back_equal_across_rollovers(
    tmp_path_factory: pytest.TempPathFactory, txs, seg_size
) -> None:
    """Any sequence of transactions, written with any segment size, reads back equal and in order."""
    directory = tmp_path_factory.mktemp("wal")
    records = []
    for n, tx in enumerate(txs):
        entries = [
            DataEntry(
                cache_id=n % 3,
                op=op,
                key=msgspec.Raw(enc.encode(k)),
                value=NIL if op == Op.DELETE else msgspec.Raw(enc.encode(v)),
                partition=n,
                version=CacheVersion(n, 1, 1, 1),
            )
            for k, op, v in tx
        ]
        records.append(DataRecord(tuple(entries), n))
    write_log(directory, records, segment_size=seg_size)
    got = [r for _, r in read_all(directory)]
    assert got == records
    decoded = [[(e.decoded_key(), e.op, e.decoded_value()) for e in r.entries] for r in got]
    assert decoded == [[(k, op, None if op == Op.DELETE else v) for k, op, v in tx] for tx in txs]


def one_segment(tmp_path: Path, n: int = 5) -> tuple[Path, list[WalPointer]]:
    ptrs = write_log(tmp_path, [DataRecord((entry(i),), i) for i in range(n)], segment_size=1 << 20)
    return tmp_path / segment_name(0), ptrs


def test_flipped_byte_is_corrupt_record_naming_segment_and_offset(tmp_path: Path) -> None:
    """A flipped payload byte raises CorruptRecord naming the file, the record offset and both CRCs."""
    path, ptrs = one_segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[ptrs[2].offset + 12] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord) as info:
        list(SegmentReader(path))
    err = info.value
    assert err.offset == ptrs[2].offset
    assert str(path) in str(err)
    assert "CRC mismatch in segment 0: expected" in str(err)
    assert f"at offset {ptrs[2].offset}" in str(err)


def test_corrupt_record_in_active_segment_is_not_skipped(tmp_path: Path) -> None:
    """In an active segment a bad CRC followed by more data is corruption, not a torn tail."""
    path, ptrs = one_segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[ptrs[1].offset + 12] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord):
        list(SegmentReader(path, archived=False))


def test_archived_segment_cut_short_is_truncated(tmp_path: Path) -> None:
    """An archived segment cut anywhere before its SegmentEnd raises TruncatedSegment naming file and offset."""
    path, ptrs = one_segment(tmp_path)
    full = path.read_bytes()
    for cut in (ptrs[3].offset, ptrs[3].offset + 5, len(full) - 1):
        path.write_bytes(full[:cut])
        with pytest.raises(TruncatedSegment) as info:
            list(SegmentReader(path))
        assert str(path) in str(info.value)
        assert info.value.offset is not None and info.value.offset <= cut


def test_active_segment_short_tail_is_end_of_data(tmp_path: Path) -> None:
    """An active segment ending in a partial frame or zeros yields the whole records before it."""
    path, ptrs = one_segment(tmp_path)
    full = path.read_bytes()
    path.write_bytes(full[: ptrs[3].offset + 6])
    reader = SegmentReader(path, archived=False)
    assert [p for p, _ in reader] == ptrs[:3]
    assert reader.end_offset == ptrs[3].offset
    path.write_bytes(full[: ptrs[3].offset] + bytes(100))
    reader = SegmentReader(path, archived=False)
    assert [p for p, _ in reader] == ptrs[:3]
    assert not reader.torn_tail


def test_torn_last_record_of_active_segment(tmp_path: Path) -> None:
    """A last record with a bad CRC that reaches end of file is reported as a torn tail, not returned."""
    path, ptrs = one_segment(tmp_path)
    full = bytearray(path.read_bytes()[: ptrs[4].offset + 1])  # up to record 4 ...
    end = ptrs[4].offset
    rec4 = encode_frame(DataRecord((entry(4),), 4))
    torn = bytearray(rec4)
    torn[-1] ^= 0xFF
    path.write_bytes(bytes(full[:end]) + bytes(torn))
    reader = SegmentReader(path, archived=False)
    assert [p for p, _ in reader] == ptrs[:4]
    assert reader.torn_tail and reader.end_offset == end


def test_lying_length_field_allocates_nothing_and_fails(tmp_path: Path) -> None:
    """A length field of 4 GiB in an archived segment is TruncatedSegment, read without allocating it."""
    path, ptrs = one_segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[ptrs[1].offset : ptrs[1].offset + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(TruncatedSegment, match="runs past end of file"):
        list(SegmentReader(path))


def test_unknown_record_type_is_corrupt(tmp_path: Path) -> None:
    """A frame with an unknown type byte (and a valid CRC) raises CorruptRecord naming the type."""
    path, ptrs = one_segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[ptrs[0].offset + 4] = 200
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord, match="unknown record type 200"):
        list(SegmentReader(path))


def test_type_byte_swapped_for_another_type_is_corrupt(tmp_path: Path) -> None:
    """A frame whose type byte names another known type fails payload validation as CorruptRecord."""
    path, ptrs = one_segment(tmp_path)
    data = bytearray(path.read_bytes())
    data[ptrs[0].offset + 4] = Checkpoint.TYPE
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord, match=r"record type 7 does not match its payload's tag"):
        list(SegmentReader(path))


def test_bad_header_and_wrong_segment_in_header(tmp_path: Path) -> None:
    """A header with bad magic, or naming another segment than the file name, is BadSegmentHeader."""
    path, _ = one_segment(tmp_path)
    data = path.read_bytes()
    path.write_bytes(b"X" + data[1:])
    with pytest.raises(BadSegmentHeader, match="bad magic"):
        list(SegmentReader(path))
    other = tmp_path / segment_name(9)
    other.write_bytes(data)
    with pytest.raises(BadSegmentHeader, match="header says segment 0, file name says 9"):
        list(SegmentReader(other))


def test_data_after_segment_end_is_corrupt(tmp_path: Path) -> None:
    """Bytes after an archived segment's SegmentEnd are reported, not ignored."""
    path, _ = one_segment(tmp_path)
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(CorruptRecord, match="4 bytes after SegmentEnd"):
        list(SegmentReader(path))


def test_gap_is_missing_segment(tmp_path: Path) -> None:
    """A hole in the segment numbering raises MissingSegment naming the segment."""
    ptrs = write_log(tmp_path, [DataRecord((entry(i),), i) for i in range(300)], segment_size=1024)
    assert ptrs[-1].segment >= 3
    os.unlink(tmp_path / segment_name(2))
    with pytest.raises(MissingSegment, match="missing segment 2"):
        list(WalReader([tmp_path]))
    with pytest.raises(MissingSegment, match="missing segment 2"):
        list(WalReader([tmp_path], WalPointer(2, 0)))


def test_reader_refuses_symlinks_and_foreign_files(tmp_path: Path) -> None:
    """Symlinks and non-segment names in a directory are never read as segments."""
    write_log(tmp_path, [DataRecord((entry(1),), 1)], segment_size=4096)
    outside = tmp_path / "outside"
    outside.mkdir()
    write_log(outside, [DataRecord((entry(2),), 2)], segment_size=4096, first_segment=1)
    os.symlink(outside / segment_name(1), tmp_path / segment_name(1))
    (tmp_path / "notes.txt").write_text("hello")
    got = read_all(tmp_path)
    assert [r.entries[0].decoded_key() for _, r in got] == [1]


def test_small_read_buffer_reads_big_records(tmp_path: Path) -> None:
    """Records bigger than the read buffer are read whole (the buffer only bounds memory, not size)."""
    big = [DataRecord((entry(i, value="x" * 5000),), i) for i in range(5)]
    write_log(tmp_path, big, segment_size=1 << 20)
    got = [r for _, r in SegmentReader(tmp_path / segment_name(0), read_buffer_bytes=64) if isinstance(r, DataRecord)]
    assert got == big


def test_a_stop_record_written_before_its_delivered_field_decodes() -> None:
    """``StopRealtimeCdcRecord.delivered`` was appended with a default: a Stop of an older node reads back with
    ``delivered`` None (the daemon then compares its own last delivered record only)."""
    old = msgspec.msgpack.encode([4, [4, 100, 2], "overflow"])  # tag, last, reason: the fields it had
    assert msgspec.msgpack.decode(old, type=StopRealtimeCdcRecord) == StopRealtimeCdcRecord(
        WalPosition(4, 100, 2), "overflow", None
    )
