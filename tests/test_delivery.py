"""What reaches a consumer: Ignite's iterator semantics and ``cdc_enabled = false`` (DESIGN §7).

A consumer that stops iterating early has taken only what it pulled: the position committed is
the one after its last event, also inside a multi-entry record, and the rest comes in the next
call. A cache with ``cdc_enabled = false`` never reaches a consumer (no events, not in slices,
no ``on_cache_change``), its positions are passed all the same, and ``resend`` refuses it.

The reference is the WAL (``wal_events``); every test checks the exact sequence delivered, for
the daemon (``sync_once`` and ``cdcd run``) and for the node's realtime worker.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from cdcd import metrics
from cdcd.consumer import CacheInfo, Consumer, EventBatch
from cdcd.daemon.committer import ConsumerFailed
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon.processor import Batch, CacheChange, Processor
from cdcd.daemon.state import Mode
from cdcd.node import Node
from cdcd.node.realtime import RealtimeMode
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.wal import WalPointer
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheConfig, CacheOp, CacheRecord, CacheVersion, DataEntry, DataRecord, Op
from tests.test_daemon_e2e import (
    CDCD,
    cdc_links,
    child_env,
    read_jsonl,
    start_daemon,
    stop_daemon,
    wait_for,
    wal_events,
    write_daemon_config,
)

Pos = list[int]


def _pos(p: WalPosition) -> Pos:
    return [p.segment, p.offset, p.entry_index]


class Recorder(Consumer):
    """Logs every event it pulls, and cache changes, as JSON lines in ``path`` (flushed per line).

    ``per_call``: events pulled per call, then it stops iterating (0: the whole batch).
    ``fail_at``: call number that raises before pulling anything."""

    def __init__(self, path: str, per_call: int = 0, fail_at: int = 0) -> None:
        self.path, self.per_call, self.fail_at = path, per_call, fail_at
        self.calls = 0

    def _log(self, obj: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        self._log({"caches": sorted(c.name for c in caches)})

    def on_cache_destroy(self, cache_ids: Sequence[int]) -> None:
        self._log({"destroyed": list(cache_ids)})

    def on_events(self, batch: EventBatch) -> bool:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"sink down at call {self.calls}")
        if not len(batch):
            return True
        n = 0
        for ev in batch:
            self._log({"cache": ev.cache_name, "op": ev.op_name, "key": ev.key, "pos": _pos(ev.position), "of": len(batch)})
            n += 1
            if n == self.per_call:
                break
        return True


def recorded(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def events_of(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: e[k] for k in ("cache", "op", "key", "pos")} for e in lines if "pos" in e]


def reference(node_dir: Path, caches: Sequence[str] | None = None) -> list[dict[str, Any]]:
    return [
        {"cache": e["cache"], "op": e["op"], "key": e["key"], "pos": e["pos"]}
        for e in wal_events(node_dir)
        if caches is None or e["cache"] in caches
    ]


def write_mixed(node: Node) -> None:
    """15 entries: 5 single puts, a ``put_all`` of 5 (one record), a transaction of 5 over two caches."""
    a = node.cache("a")
    node.cache("b")
    for k in range(5):
        a.put(k, {"v": k})
    a.put_all({10 + k: {"v": k} for k in range(5)})
    with node.transaction() as tx:
        tx.put("a", 20, 1)
        tx.put("b", 21, 2)
        tx.put("a", 22, 3)
        tx.put("b", 23, 4)
        tx.remove("a", 0)


def daemon_config(node_dir: Path, **settings: Any) -> DaemonConfig:
    return DaemonConfig(node_dir=str(node_dir), metrics_address="", consumer={"kind": "null"}, **settings)


def events_metric(cache: str, op: str) -> float:
    value = REGISTRY.get_sample_value("cdcd_daemon_events_total", {"cache": cache, "op": op})
    return value or 0.0


def end_of_wal(node_dir: Path) -> WalPosition:
    """Where a daemon that consumed every link stands: the start of the segment after the last."""
    return WalPosition(max(cdc_links(node_dir)) + 1, 0, 0)


# --- 1. a consumer that stops iterating early ----------------------------------------------------------
def test_daemon_one_event_per_call_sees_every_event_once_in_order(tmp_path: Path) -> None:
    """A consumer that pulls one event per call and returns True gets all 15 events exactly once, in WAL order,
    each call the rest of the batch; a failure at call 8 (inside the put_all record) leaves the position right
    after event 7 (entry index 2 of that record), and a restart delivers exactly events 8..15."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        write_mixed(node)
        node.force_archive()
    ref = reference(node_dir)
    assert len(ref) == 15 and len({tuple(e["pos"][:2]) for e in ref}) == 7, "5 + 1 + 1 records"
    end = end_of_wal(node_dir)
    before = {(c, op): events_metric(c, op) for c in "ab" for op in ("create", "update", "delete")}

    # A first run fails at call 8: seven events were taken and committed, one at a time.
    log1 = tmp_path / "first.jsonl"
    with Daemon(daemon_config(node_dir), Recorder(str(log1), per_call=1, fail_at=8)) as daemon:
        with pytest.raises(ConsumerFailed, match="sink down at call 8"):
            daemon.sync_once()
        assert daemon.state.position == WalPosition(*ref[7]["pos"])
        assert ref[7]["pos"][2] == 2, "inside the put_all record"
        assert daemon.events_delivered == 7
    first = recorded(log1)
    assert events_of(first) == ref[:7]
    assert [e["of"] for e in first if "pos" in e] == [15, 14, 13, 12, 11, 10, 9], "each call: the rest of the batch"

    log2 = tmp_path / "second.jsonl"
    with Daemon(daemon_config(node_dir), Recorder(str(log2), per_call=1)) as daemon:
        assert daemon.sync_once() == 8
        assert daemon.state.position == end
        assert daemon.events_delivered == 8
    second = recorded(log2)
    assert events_of(second) == ref[7:]
    assert [e["of"] for e in second if "pos" in e] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert cdc_links(node_dir) == {}, "every link deleted once consumed"
    # Counted as taken: 15 in all (a: 5 + 5 creates, 2 creates, 1 delete; b: 2 creates).
    after = {(c, op): events_metric(c, op) - v for (c, op), v in before.items()}
    assert after == {
        ("a", "create"): 12.0,
        ("a", "update"): 0.0,
        ("a", "delete"): 1.0,
        ("b", "create"): 2.0,
        ("b", "update"): 0.0,
        ("b", "delete"): 0.0,
    }


@pytest.mark.parametrize("how", ["slices", "count", "iterate"])
def test_daemon_batch_taken_whole_by_slices_counting_or_full_iteration(tmp_path: Path, how: str) -> None:
    """Reading ``slices`` (a sink), never iterating (a counter) or iterating to the end takes the whole batch: one
    call, and the position at the end."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        write_mixed(node)
        node.force_archive()
    end = end_of_wal(node_dir)

    class Taking(Consumer):
        calls = 0

        def on_events(self, batch: EventBatch) -> bool:
            self.calls += 1
            if how == "slices":
                assert sum(s.end - s.start for s in batch.slices) == 15
            elif how == "iterate":
                assert len(list(batch)) == 15
            return True

    consumer = Taking()
    with Daemon(daemon_config(node_dir), consumer) as daemon:
        assert daemon.sync_once() == 15
        assert consumer.calls == 1
        assert daemon.state.position == end
