"""A consumer that returns False (Ignite's "not durable yet": nothing is committed until a call returns True) is
asked again with a call without events once the daemon has nothing more for it: caught up (``sync_once``, and
``cdcd run`` after the last batch), before it stops, before a bad spot's error. The position then moves to the
end of what it took; a consumer that still says False keeps it where it was, and is asked again later rather than
in a loop. The lake's Spark writer relies on this (``LakeOptions.write_ahead_max_s``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cdcd.consumer import Consumer, EventBatch
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon_state import read_daemon_state
from cdcd.node import Node
from cdcd.wal import CacheRecord, DataRecord, SegmentReader
from cdcd.wal.errors import WalError
from cdcd.wal.frame import FRAME_HEADER_SIZE
from tests.support.config import write_daemon_config
from tests.support.procs import start_daemon, stop_daemon, wait_for
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events


def _write(node_dir: Path, puts: int) -> None:
    with Node.open(node_dir, wal_segment_size_bytes=1 << 20, wal_force_archive_timeout_ms=0) as node:
        cache = node.cache("a")
        for k in range(puts):
            cache.put(k, {"v": k})
        node.force_archive()


class Deferring(Consumer):
    """Logs what it pulls and each call's size to ``path``; returns False for a call with events and
    ``confirm_empty`` for a call without (True: it confirms what it holds once asked)."""

    def __init__(self, path: str, confirm_empty: bool = True) -> None:
        self.path, self.confirm_empty = path, confirm_empty

    def _log(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def on_events(self, batch: EventBatch) -> bool:
        self._log({"call": len(batch)})
        if not len(batch):
            return self.confirm_empty
        for ev in batch:
            self._log({"key": ev.key, "pos": [ev.position.segment, ev.position.offset, ev.position.entry_index]})
        return False


def _position(node_dir: Path) -> list[int] | None:
    """The committed position's (segment, offset, entries done), as the state store holds it."""
    state = read_daemon_state(node_dir / "cdcd-state")
    return None if state is None or state["position_parts"] is None else list(state["position_parts"])


def _keys(path: Path) -> list[int]:
    return [line["key"] for line in read_jsonl(path) if "key" in line]


def _calls(path: Path) -> list[int]:
    return [line["call"] for line in read_jsonl(path) if "call" in line]


def test_sync_once_confirms_at_the_end_and_commits_the_position_after_everything(tmp_path: Path) -> None:
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    _write(node_dir, 50)
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=20)
    with Daemon(config, Deferring(str(log))) as daemon:
        assert daemon.sync_once() == 50
        position = daemon.state.position
    assert _keys(log) == list(range(50))
    assert _calls(log) == [20, 20, 10, 0], "three batches unconfirmed, then one call without events"
    assert position is not None and position.segment >= 1, "past every linked segment"
    assert _position(node_dir) == [position.segment, position.offset, position.entry_index]


def test_a_consumer_that_does_not_confirm_keeps_the_position(tmp_path: Path) -> None:
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    _write(node_dir, 50)
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=20)
    with Daemon(config, Deferring(str(log), confirm_empty=False)) as daemon:
        assert daemon.sync_once() == 50
        position = daemon.state.position
        assert _calls(log) == [20, 20, 10, 0], "asked once at the end of reading, not in a loop"
    assert _keys(log) == list(range(50))
    assert _calls(log) == [20, 20, 10, 0, 0], "and once more at the stop"
    first = wal_events(node_dir)[0]["pos"]
    assert position is not None and (position.segment, position.offset) < (first[0], first[1]), (
        "nothing confirmed: the position stays before every event (past the cache's creation only)"
    )
    assert _position(node_dir) == [position.segment, position.offset, position.entry_index]


def test_before_a_bad_spots_error_what_came_before_it_is_confirmed_and_committed(tmp_path: Path) -> None:
    """A flipped byte in a record of the second segment: the events read before it are delivered, the consumer is
    asked to confirm them before the error is raised, and the position committed is right after them (nothing at or
    after the bad record)."""
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    with Node.open(node_dir, wal_segment_size_bytes=1 << 20, wal_force_archive_timeout_ms=0) as node:
        cache = node.cache("a")
        for segment in range(2):
            for k in range(segment * 30, segment * 30 + 30):
                cache.put(k, {"v": k})
            node.force_archive()
    data_records = [p for p, r in SegmentReader(archived_segments(node_dir)[1]) if type(r) is DataRecord]
    bad = data_records[10].offset
    link = cdc_links(node_dir)[1]
    data = bytearray(link.read_bytes())
    data[bad + FRAME_HEADER_SIZE + 5] ^= 0x20
    tmp = link.with_name(link.name + ".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, link)  # the archive, which shares its inode, stays intact
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=20)
    with Daemon(config, Deferring(str(log))) as daemon:
        with pytest.raises(WalError, match=f"at offset {bad}"):
            daemon.sync_once()
        position = daemon.state.position
    events = wal_events(node_dir)
    keys = _keys(log)
    assert 30 <= len(keys) <= 40 and keys == [e["key"] for e in events[: len(keys)]], "what the reader read before it"
    assert _calls(log)[-1] == 0, "confirmed before the error"
    assert position is not None
    at = [position.segment, position.offset, position.entry_index]
    assert events[len(keys) - 1]["pos"] < at <= events[len(keys)]["pos"], "past what it took, not past the rest"
    assert at <= [1, bad, 0] and _position(node_dir) == at


def test_a_cache_dropped_after_the_last_batch_is_committed_with_it_once_confirmed(tmp_path: Path) -> None:
    """A batch taken unconfirmed, then a cache's DESTROY as the WAL's last record: the consumer hears of the drop,
    and the call without events that confirms the batch commits the position past the DESTROY too (a restart does
    not meet it again)."""
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    with Node.open(node_dir, wal_segment_size_bytes=1 << 20, wal_force_archive_timeout_ms=0) as node:
        for k in range(10):
            node.cache("a").put(k, {"v": k})
        node.cache("b").put(0, {"v": 0})
        node.destroy_cache("b")
        node.force_archive()
    destroy = [p for p, r in SegmentReader(archived_segments(node_dir)[0]) if type(r) is CacheRecord][-1]
    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=100)
    with Daemon(config, Deferring(str(log))) as daemon:
        assert daemon.sync_once() == 11
        position = daemon.state.position
    assert _calls(log) == [11, 0]
    assert position is not None and (position.segment, position.offset) > (destroy.segment, destroy.offset)


def test_cdcd_run_confirms_after_the_last_batch_and_at_its_stop(tmp_path: Path) -> None:
    """``cdcd run``: the position reaches the end once caught up (the call without events came); more writes
    later are delivered and confirmed the same way; SIGTERM ends it with the position at the end."""
    node_dir, log = tmp_path / "node", tmp_path / "calls.jsonl"
    _write(node_dir, 30)
    consumer = {"kind": "python", "class": "tests.test_delivery_confirm:Deferring", "options": {"path": str(log)}}
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=20)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: 0 in _calls(log) if log.exists() else False, 60, "the confirming call")
        wait_for(lambda: _position(node_dir) is not None, 30, "the position committed")
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]
    assert _keys(log) == [e["key"] for e in wal_events(node_dir)] == list(range(30))
    calls = _calls(log)
    assert sum(calls) == 30 and calls[-1] == 0 and calls.count(0) >= 1
    position = _position(node_dir)
    assert position is not None and position[0] >= 1
