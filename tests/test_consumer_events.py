"""Events and batches as a consumer sees them, over records a real node wrote: every event field,
and ``split_taken`` after an iteration stopped inside a record."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from cdcd.consumer import EventBatch, RecordSlice
from cdcd.node import Node
from cdcd.wal import DataRecord, Op, WalPointer, WalReader
from cdcd.wal.pointer import EventAddress
from cdcd.wal.segment import list_segments


def _data_records(node_dir: Path) -> list[tuple[WalPointer, DataRecord]]:
    work, _ = list_segments(node_dir / "wal")
    reader = WalReader([node_dir / "wal" / "archive", node_dir / "wal"], active_segment=max(work) if work else None)
    return [(p, r) for p, r in reader if isinstance(r, DataRecord)]


@pytest.fixture
def written(tmp_path: Path) -> tuple[list[tuple[WalPointer, DataRecord]], dict[int, str]]:
    """Three transactions over two caches: a mixed 5-entry one, a put with a TTL and a remove."""
    with Node.open(tmp_path / "node") as node:
        a, b = node.cache("a"), node.cache("b")
        with node.transaction() as tx:
            tx.put("a", 1, {"v": 1})
            tx.put("b", "k", [1, 2])
            tx.put("a", 2, "two")
            tx.put("b", ("t", 3), "three")
            tx.put("a", 3, b"\x00\xff")
        a.put(4, 4.5, ttl_ms=60_000)
        a.remove(1)
        names = {a.cache_id: "a", b.cache_id: "b"}
    records = _data_records(tmp_path / "node")
    assert [len(r.entries) for _, r in records] == [5, 1, 1]
    return records, names


def _expected(records: list[tuple[WalPointer, DataRecord]], start: int) -> list[dict[str, object]]:
    """What the events must say, straight from the records (the first slice from entry ``start``)."""
    out = []
    for n, (ptr, rec) in enumerate(records):
        for i, e in enumerate(rec.entries):
            if n == 0 and i < start:
                continue
            out.append(
                {
                    "cache_id": e.cache_id,
                    "op": e.op,
                    "key": msgspec.msgpack.decode(e.key),
                    "value": msgspec.msgpack.decode(e.value),
                    "key_bytes": bytes(e.key),
                    "value_bytes": bytes(e.value),
                    "commit_ts_ns": rec.commit_ts_ns,
                    "position": EventAddress(ptr.segment, ptr.offset, i),
                    "partition": e.partition,
                    "primary": e.primary,
                    "expire_time_ms": e.expire_time_ms,
                    "version": e.version,
                }
            )
    return out


def test_events_carry_every_field_of_their_entry_and_record(written) -> None:
    records, names = written
    slices = [RecordSlice(p, r, 1 if k == 0 else 0) for k, (p, r) in enumerate(records)]
    batch = EventBatch("node-1", slices, names)
    events = list(batch)
    expected = _expected(records, start=1)
    assert len(events) == len(batch) == len(expected) == 6
    for ev, want in zip(events, expected, strict=True):
        got = {k: getattr(ev, k) for k in want}
        assert got == want
        assert ev.cache_name == names[ev.cache_id]
        assert ev.op_name == Op(ev.op).name.lower()
        assert bytes(ev.entry.key) == want["key_bytes"]
    assert [ev.key for ev in events] == ["k", 2, ["t", 3], 3, 4, 1]
    assert events[-1].op is Op.DELETE and events[-1].value is None
    assert events[-2].expire_time_ms > 0
    assert batch.split_taken() == (slices, None)  # iterated to the end: took it all
    # Events compare and hash by identity, as plain objects do: a consumer may keep them in sets.
    again = list(EventBatch("node-1", slices, names))
    assert len({*events, *again}) == 12 and events[0] != again[0] and events[0] == events[0]


def test_unknown_cache_ids_get_a_placeholder_name(written) -> None:
    records, names = written
    batch = EventBatch("node-1", [RecordSlice(*records[0])], {})
    assert {ev.cache_name for ev in batch} == {f"cache-{cid}" for cid in names}


@pytest.mark.parametrize("pulled", [0, 1, 3, 4, 5, 6])
def test_split_taken_after_an_iteration_stopped_inside_a_record(written, pulled: int) -> None:
    """The consumer pulls ``pulled`` events of [entries 1-4 of tx 0, tx 1, tx 2]: it took exactly those."""
    records, names = written
    slices = [RecordSlice(p, r, 1 if k == 0 else 0) for k, (p, r) in enumerate(records)]
    batch = EventBatch("node-1", slices, names)
    it = iter(batch)
    pulled_positions = [next(it).position for _ in range(pulled)]
    taken, rest = batch.split_taken()
    everything = [ev.position for ev in EventBatch("node-1", slices, names)]
    taken_positions = [ev.position for ev in EventBatch("node-1", taken, names)]
    assert taken_positions == pulled_positions == everything[:pulled]
    if pulled == len(everything):
        # The last event was pulled but the iterator not exhausted: nothing is left either way.
        assert rest is None
    else:
        assert rest is not None and [ev.position for ev in rest] == everything[pulled:]
        assert rest.first == everything[pulled] and len(rest) == len(everything) - pulled


def test_a_second_iteration_keeps_how_far_the_first_got(written) -> None:
    records, names = written
    slices = [RecordSlice(p, r) for p, r in records]
    batch = EventBatch("node-1", slices, names)
    first = iter(batch)
    for _ in range(4):
        next(first)
    second = iter(batch)
    next(second)
    taken, rest = batch.split_taken()
    assert [ev.position for ev in EventBatch("n", taken, names)] == [
        EventAddress(records[0][0].segment, records[0][0].offset, i) for i in range(4)
    ]
    assert rest is not None and len(rest) == 3
