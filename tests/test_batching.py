"""The shared position filter and batcher (cdcd/delivery.py) and the two position types."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cdcd.consumer import CacheInfo, Consumer, EventBatch, RecordSlice
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon.processor import Processor
from cdcd.daemon_state import CdcMode, DaemonState
from cdcd.delivery import Batch, CacheChange, slices_from
from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.wal.pointer import EventAddress, WalPointer, WalPosition
from cdcd.wal.records import (
    CacheConfig,
    CacheOp,
    CacheRecord,
    CacheVersion,
    DataEntry,
    DataRecord,
    Op,
    RealtimeCdcRecord,
)
from tests.support.procs import wait_for


def _data(cache_id: int, *keys: int) -> DataRecord:
    v = CacheVersion(1, 1, 1, 1)
    raw = [msgspec.Raw(msgspec.msgpack.encode(k)) for k in keys]
    return DataRecord(tuple(DataEntry(cache_id, Op.CREATE, r, r, 0, v) for r in raw), 1)


# --- positions -------------------------------------------------------------------------------------
def test_a_cursor_counts_the_entries_before_it_and_an_address_converts_to_cursors() -> None:
    cursor = WalPosition(3, 100, 2)
    assert cursor.entries_done(WalPointer(2, 900), 5) == 5  # an earlier segment
    assert cursor.entries_done(WalPointer(3, 50), 5) == 5  # an earlier record
    assert cursor.entries_done(WalPointer(3, 100), 5) == 2  # inside the record
    assert cursor.entries_done(WalPointer(3, 100), 1) == 1  # a marker the cursor is past
    assert cursor.entries_done(WalPointer(3, 150), 5) == 0
    assert cursor.entries_done(WalPointer(4, 0), 5) == 0
    assert cursor.covers(EventAddress(3, 100, 1)) and not cursor.covers(EventAddress(3, 100, 2))
    address = EventAddress(3, 100, 2)
    assert address.cursor() == cursor and address.next_cursor() == WalPosition(3, 100, 3)
    assert str(address) == str(cursor) == "3:100#2"


def test_both_position_types_keep_the_on_disk_encoding() -> None:
    """Daemon state and marker records store positions as arrays of (segment, offset, entry_index)."""
    enc = msgspec.msgpack.encode
    assert enc(WalPosition(7, 8, 9)) == enc(EventAddress(7, 8, 9)) == enc([7, 8, 9])
    old_state = enc({"mode": "ACTIVE", "position": [7, 8, 9], "updated_ns": 1, "commits": 2, "node_id": "n"})
    state = msgspec.msgpack.decode(old_state, type=DaemonState)
    assert state.position == WalPosition(7, 8, 9) and state.mode is CdcMode.DAEMON_ACTIVE
    marker = msgspec.msgpack.decode(enc(RealtimeCdcRecord(WalPosition(1, 2, 3))), type=RealtimeCdcRecord)
    assert marker.last == WalPosition(1, 2, 3)


# --- the position filter ---------------------------------------------------------------------------
def _slices() -> list[RecordSlice]:
    a, b, c = _data(1, 1, 2, 3), _data(1, 4, 5), _data(1, 6, 7, 8, 9)
    return [
        RecordSlice(WalPointer(0, 10), a, 1),  # entries 1..2 (0 went earlier)
        RecordSlice(WalPointer(0, 90), b),
        RecordSlice(WalPointer(1, 20), c, 0, 2),  # a record split around a cache with CDC off
        RecordSlice(WalPointer(1, 20), c, 3),
    ]


def _events(slices: Sequence[RecordSlice]) -> list[tuple[int, int, int]]:
    return [(s.pointer.segment, s.pointer.offset, i) for s in slices for i in range(s.start, s.end)]


def test_slices_from_keeps_exactly_the_events_at_or_after_the_cursor() -> None:
    slices = _slices()
    every = _events(slices)
    assert slices_from(slices, None) == slices
    cursors = [WalPosition(*e) for e in every] + [WalPosition(0, 0), WalPosition(0, 10, 0), WalPosition(2, 0)]
    for cursor in cursors:
        kept = _events(slices_from(slices, cursor))
        assert kept == [e for e in every if not cursor.covers(EventAddress(*e))], cursor


# --- the batcher: caches do not cut batches ----------------------------------------------------------
CACHES = 1000


def _many_caches() -> list[tuple[WalPointer, Any, int, None]]:
    out: list[tuple[WalPointer, Any, int, None]] = []
    for cid in range(1, CACHES + 1):
        out.append(
            (WalPointer(0, len(out) * 100), CacheRecord(cid, f"c{cid}", CacheOp.CREATE, CacheConfig()), 50, None)
        )
        out.append((WalPointer(0, len(out) * 100), _data(cid, 1, 2), 50, None))
    return out


def test_new_caches_do_not_cut_the_batch_and_are_announced_before_their_events() -> None:
    """1000 caches x 2 entries make one batch (was one per cache): every cache's CacheChange comes before the
    batch with its events; only the first (no batch open yet) commits a position of its own."""
    p = Processor(
        mode=CdcMode.DAEMON_ACTIVE,
        position=None,
        caches={},
        source_node="n",
        batch_max_events=50_000,
        batch_max_bytes=1 << 30,
    )
    items = p.feed_many(_many_caches())
    items.append(p.close_batch())
    batches = [i for i in items if isinstance(i, Batch)]
    changes = [i for i in items if isinstance(i, CacheChange)]
    assert [len(b.events) for b in batches] == [2 * CACHES]
    assert len(changes) == CACHES and items.index(batches[0]) == CACHES
    assert changes[0].end == WalPosition(0, 0, 1) and all(c.end is None for c in changes[1:])
    assert batches[0].end == WalPosition(0, (2 * CACHES - 1) * 100, 2)


def test_a_destroy_or_a_new_config_still_cuts_the_batch() -> None:
    """Events before a DESTROY, or before a CREATE that changes a known cache, are delivered before it."""
    p = Processor(
        mode=CdcMode.DAEMON_ACTIVE,
        position=None,
        caches={},
        source_node="n",
        batch_max_events=1000,
        batch_max_bytes=1 << 20,
    )
    recs: list[Any] = [
        CacheRecord(1, "a", CacheOp.CREATE, CacheConfig()),
        _data(1, 1),
        CacheRecord(2, "b", CacheOp.CREATE, CacheConfig()),  # new: joins
        _data(2, 2),
        CacheRecord(1, "a", CacheOp.CREATE, CacheConfig(partitions=8)),  # changed: cuts
        _data(1, 3),
        CacheRecord(2, "b", CacheOp.DESTROY, CacheConfig()),  # cuts
    ]
    items: list[Any] = []
    for i, rec in enumerate(recs):
        items += p.feed(WalPointer(0, i * 100), rec, 10)
    kinds = [
        ("batch", [e.key for e in i.events], i.end) if isinstance(i, Batch) else ("change", i.end is not None)
        for i in items
    ]
    assert kinds == [
        ("change", True),
        ("change", False),
        ("batch", [1, 2], WalPosition(0, 400, 0)),
        ("change", True),
        ("batch", [3], WalPosition(0, 600, 0)),
        ("change", True),
    ]


class CallLog(Consumer):
    """Logs every call (one JSON line each) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: list[dict[str, Any]] = []

    def _log(self, line: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        self._log({"call": "cache", "names": [c.name for c in caches]})

    def on_events(self, batch: EventBatch) -> bool:
        self._log({"call": "events", "events": [[e.cache_name, e.key] for e in batch]})
        return True


class GatedCallLog(CallLog):
    """``CallLog`` whose first ``on_events`` waits for the file ``gate``: what is written meanwhile piles up."""

    def __init__(self, path: str, gate: str) -> None:
        super().__init__(path)
        self.gate = Path(gate)
        self.opened = False

    def on_events(self, batch: EventBatch) -> bool:
        if not self.opened:
            wait_for(self.gate.exists, 120, f"the gate {self.gate}")
            self.opened = True
        return super().on_events(batch)


def _check_calls(path: Path) -> list[dict[str, Any]]:
    """Every cache announced before its events; returns the on_events calls."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    announced: set[str] = set()
    calls = []
    for line in lines:
        if line["call"] == "cache":
            announced.update(line["names"])
        else:
            calls.append(line)
            missing = {name for name, _key in line["events"]} - announced
            assert not missing, f"events of caches not announced first: {sorted(missing)[:5]}"
    return calls


def _write_many_caches(node: Node) -> None:
    for i in range(CACHES):
        node.cache(f"c{i}").put_all({1: i, 2: i})


def _expected() -> list[list[Any]]:
    return sorted([f"c{i}", k] for i in range(CACHES) for k in (1, 2))


def test_daemon_delivers_a_thousand_new_caches_in_few_batches(tmp_path: Path) -> None:
    """1000 caches x 2 entries through a real node and daemon: every event exactly once, each cache announced
    before its events, in one or two on_events calls (one per cache before)."""
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    with Node.open(node_dir) as node:
        _write_many_caches(node)
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer={"kind": "null"})
    with Daemon(config, CallLog(str(log)), show_progress=False) as daemon:
        assert daemon.sync_once() == 2 * CACHES
    calls = _check_calls(log)
    assert sorted(e for c in calls for e in c["events"]) == _expected()
    assert len(calls) <= 2, [len(c["events"]) for c in calls]


@pytest.mark.timeout(300)
def test_realtime_delivers_a_thousand_new_caches_in_few_batches(tmp_path: Path) -> None:
    """The node's realtime worker, while its consumer holds the first batch, gets 1000 caches x 2 entries: every
    event once, each cache announced before its events, and the backlog in a few calls (one per cache before)."""
    node_dir, log, gate = tmp_path / "node", tmp_path / "calls.jsonl", tmp_path / "gate"
    options = {"path": str(log), "gate": str(gate)}
    consumer = {"kind": "python", "class": "tests.test_batching:GatedCallLog", "options": options}
    with Node.open(node_dir, realtime_cdc=True, realtime_consumer=consumer, cdc_enabled=False) as node:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        _write_many_caches(node)
        node.flush()
        gate.touch()
        wait_for(lambda: log.exists() and len(_delivered(log)) == 2 * CACHES, 120, "every event delivered")
    calls = _check_calls(log)
    assert sorted(e for c in calls for e in c["events"]) == _expected()
    assert len(calls) <= 4, [len(c["events"]) for c in calls]


def _delivered(log: Path) -> list[Any]:
    return [e for line in log.read_text().splitlines() for e in json.loads(line).get("events", [])]
