"""The WAL's record bytes carried to the lake (``RecordSlice.payload``): what the daemon reads from a real node's
segments reaches ``arrow.pack`` as the bytes the node wrote, and the packed message is byte for byte the one an
encoding of the decoded records gives, on every path a slice is cut by (a resume inside a record, a cache with CDC
off inside a transaction, a consumer taking part of a batch, a refused event split out); the C and the Python row
builders read it into the same table. The CRC is still checked on this path: a flipped byte is a
``CorruptRecord`` naming the file and the record's offset."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from cdcd.consumer import EventBatch, RecordSlice
from cdcd.daemon.follower import SegmentFollower
from cdcd.daemon.processor import Batch, Processor
from cdcd.daemon_state import CdcMode
from cdcd.delivery import slices_from, split_at
from cdcd.lake.landing import _rows, rows_py
from cdcd.lake.landing.arrow import pack, table_from_packed
from cdcd.lake.landing.jsontext import key_json_bytes, to_json_bytes
from cdcd.lake.landing.spark_write import ship, unship
from cdcd.node.node import Node
from cdcd.wal.errors import CorruptRecord
from cdcd.wal.frame import FRAME_HEADER_SIZE
from cdcd.wal.pointer import EventAddress, WalPosition
from cdcd.wal.reader import SegmentReader
from cdcd.wal.records import CacheInfo, DataRecord
from cdcd.wal.segment import list_segments


def _write_node(node_dir: Path) -> None:
    """A node's WAL with what a record can hold: several caches in one transaction (one with CDC off), updates,
    deletes, TTLs, nested and odd keys and values; archived, so every segment is complete."""
    node = Node.open(node_dir, wal_mode="fsync", archive_max_bytes=0)
    try:
        node.cache("hidden", cdc_enabled=False)
        kv = node.cache("kv")
        for start in range(0, 600, 200):
            kv.put_all({k: {"v": "x" * (k % 7), "n": [k, -k, 1.5], 7: None} for k in range(start, start + 200)})
        kv.put_all({k: b"\x00\xff" for k in range(0, 50)}, ttl_ms=60_000)
        kv.remove_all(range(100, 130))
        for t in range(3):
            with node.transaction() as tx:
                tx.put("kv", ("tuple", t), "first")
                tx.put("hidden", t, "never delivered")
                tx.put("other", f"k{t}", 2**63 + t)
                tx.remove("kv", t)
                tx.put("kv", ("tuple", t), "second")
        node.flush()
        node.force_archive()
    finally:
        node.close()


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("payload") / "node"
    _write_node(path)
    return path


def _without_payload(slices: Sequence[RecordSlice]) -> list[RecordSlice]:
    return [RecordSlice(s.pointer, s.record, s.start, s.stop) for s in slices]


def _batches(node_dir: Path, start: WalPosition | None, caches: dict[int, CacheInfo]) -> list[Batch]:
    """The daemon's read path: the follower's chunks into the processor, in small batches."""
    follower = SegmentFollower(node_dir / "cdc", start)
    processor = Processor(
        mode=CdcMode.DAEMON_ACTIVE,
        position=start,
        caches=dict(caches),
        source_node="node-a",
        batch_max_events=170,
        batch_max_bytes=1 << 30,
    )
    out: list[Batch] = []
    while (chunk := follower.read(7)) is not None:
        if not chunk and follower.segment not in follower.scan():
            break
        out += [i for i in processor.feed_many(chunk) if isinstance(i, Batch)]
    out.append(processor.close_batch())
    return [b for b in out if len(b.events)]


def _assert_same_pack(slices: Sequence[RecordSlice]) -> bytes:
    """Every slice carries the bytes it was read from; packing them is packing the decoded records."""
    assert slices and all(s.payload is not None for s in slices)
    carried = pack(slices)
    assert carried == pack(_without_payload(slices))
    assert unship(ship(list(slices))) == carried
    return carried


def _assert_builders_agree(packed: bytes, names: dict[int, str]) -> None:
    """The C module and the Python path give the same Arrow table from the packed message."""
    c_rows = _rows.columns(packed, to_json_bytes, key_json_bytes)
    py_rows = rows_py.columns(packed, to_json_bytes, key_json_bytes)
    assert c_rows == py_rows
    table, _ = table_from_packed(packed, names, "node-a", True)
    assert table.num_rows == c_rows[0]


def _caches(node_dir: Path) -> dict[int, CacheInfo]:
    """The caches as the WAL's CacheRecords name them (what the daemon's registry holds after reading them)."""
    from cdcd.wal.records import CacheRecord

    out: dict[int, CacheInfo] = {}
    for _, path in sorted(list_segments(node_dir / "cdc")[0].items()):
        for _ptr, record in SegmentReader(path):
            if type(record) is CacheRecord:
                out[record.cache_id] = CacheInfo(record.cache_id, record.name, record.config)
    return out


def test_payloads_are_the_frames_the_node_wrote(node_dir: Path) -> None:
    """``frames()`` yields each record with the exact bytes after its frame header, and the same records
    as iterating the reader."""
    for _, path in sorted(list_segments(node_dir / "cdc")[0].items()):
        data = path.read_bytes()
        framed = list(SegmentReader(path).frames())
        assert [(p, r) for p, r, _ in framed] == list(SegmentReader(path))
        for ptr, _record, payload in framed:
            start = ptr.offset + FRAME_HEADER_SIZE
            assert payload == data[start : start + len(payload)]


def test_the_daemons_batches_pack_the_same_bytes_with_the_carried_payload(node_dir: Path) -> None:
    """Whole records, records cut at batch ends, a transaction with a cache whose CDC is off (several slices of
    one record) and a resume inside a record: every slice carries its record's bytes, the packed message
    equals the one encoding the records gives, and both row builders read the same rows from it."""
    caches = _caches(node_dir)
    names = {cid: info.name for cid, info in caches.items()}
    batches = _batches(node_dir, None, caches)
    assert sum(len(b.events) for b in batches) == 600 + 50 + 30 + 3 * 4
    cut = [s for b in batches for s in b.events.peek_slices() if s.start or s.stop is not None]
    assert cut, "no slice of part of a record: the transaction with a hidden cache makes some"
    for b in batches:
        _assert_builders_agree(_assert_same_pack(b.events.peek_slices()), names)
    # A resume inside the second data record: its first 77 entries were delivered before.
    second = [s for b in batches for s in b.events.peek_slices()][1]
    resumed = _batches(node_dir, WalPosition(second.pointer.segment, second.pointer.offset, 77), caches)
    first = resumed[0].events.peek_slices()[0]
    assert (first.pointer, first.start) == (second.pointer, 77)
    for b in resumed:
        _assert_builders_agree(_assert_same_pack(b.events.peek_slices()), names)


def test_slices_cut_after_reading_keep_their_payload(node_dir: Path) -> None:
    """What the delivery loop cuts out of a batch (a replay's filter, a consumer taking part of it, a refused
    event split out) keeps the record's bytes, and packs as the records do."""
    caches = _caches(node_dir)
    batch = _batches(node_dir, None, caches)[0]
    slices = batch.events.peek_slices()
    s = slices[0]
    replay = slices_from(slices, WalPosition(s.pointer.segment, s.pointer.offset, 10))
    assert replay[0].start == 10
    _assert_same_pack(replay)
    events = EventBatch("node-a", slices, {cid: i.name for cid, i in caches.items()})
    for n, _event in enumerate(events):
        if n == 120:
            break
    taken, rest = events.split_taken()
    assert rest is not None
    _assert_same_pack(taken)
    _assert_same_pack(rest.peek_slices())
    parts = split_at(batch.events, EventAddress(s.pointer.segment, s.pointer.offset, 5))
    assert parts is not None
    before, refused, after = parts
    assert before is not None and after is not None
    _assert_same_pack([*before.peek_slices(), refused, *after.peek_slices()])


def test_a_flipped_byte_is_still_a_corrupt_record_naming_file_and_offset(node_dir: Path, tmp_path: Path) -> None:
    """The daemon's path reads payloads after their CRC check, as before: one byte flipped inside a data
    record's payload stops the follower with the segment's path and that record's offset."""
    copy = tmp_path / "node"
    shutil.copytree(node_dir / "cdc", copy / "cdc")
    segments = list_segments(copy / "cdc")[0]
    path = segments[min(segments)]
    target = next(p for p, r in SegmentReader(path) if type(r) is DataRecord and len(r.entries) == 200)
    data = bytearray(path.read_bytes())
    data[target.offset + FRAME_HEADER_SIZE + 500] ^= 0x01
    path.unlink()  # a hard link to the archive: write a file of its own
    path.write_bytes(bytes(data))
    follower = SegmentFollower(copy / "cdc", None)
    with pytest.raises(CorruptRecord) as caught:
        while follower.read(1000):
            pass
    message = str(caught.value)
    assert str(path) in message and str(target.offset) in message and "CRC mismatch" in message
