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

import msgspec
import pytest
from prometheus_client import REGISTRY

from cdcd.consumer import CacheInfo, Consumer, EventBatch
from cdcd.daemon.committer import ConsumerFailed
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.daemon.processor import Batch, CacheChange, Processor
from cdcd.daemon_state import CdcMode
from cdcd.node import Node
from cdcd.realtime import RealtimeMode
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.wal import WalPointer
from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheConfig, CacheOp, CacheRecord, CacheVersion, DataEntry, DataRecord, Op
from tests.support.config import write_daemon_config
from tests.support.procs import CDCD, child_env, start_daemon, stop_daemon, wait_for
from tests.support.wal import cdc_links, read_jsonl, wal_events, wal_records

Pos = list[int]


def _pos(p: WalPosition) -> Pos:
    return [p.segment, p.offset, p.entry_index]


class Recorder(Consumer):
    """Logs every event it pulls, and cache changes, as JSON lines in ``path`` (flushed per line).

    ``per_call``: events pulled per call, then it stops iterating (0: the whole batch).
    ``fail_at``: call number that raises before pulling anything.
    ``hold``: while this file exists, a call starts iterating, pulls nothing and returns True."""

    def __init__(self, path: str, per_call: int = 0, fail_at: int = 0, hold: str = "") -> None:
        self.path, self.per_call, self.fail_at, self.hold = path, per_call, fail_at, hold
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
        if self.hold and os.path.exists(self.hold):
            iter(batch)
            self._log({"held": len(batch)})
            return True
        n = 0
        for ev in batch:
            pos = _pos(ev.position)
            self._log({"cache": ev.cache_name, "op": ev.op_name, "key": ev.key, "pos": pos, "of": len(batch)})
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


def test_cdcd_run_one_event_per_call_and_a_consumer_that_takes_nothing(tmp_path: Path) -> None:
    """``cdcd run`` with a python consumer that first takes nothing (iterates, pulls none, returns True): the same
    events are offered again, nothing is committed, and SIGTERM still stops the daemon (exit 0). Restarted, taking
    one event per call, it delivers all 15 exactly once in WAL order and commits the end."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        write_mixed(node)
        node.force_archive()
    ref = reference(node_dir)
    end = end_of_wal(node_dir)
    log, hold, err = tmp_path / "events.jsonl", tmp_path / "hold", tmp_path / "run.err"
    hold.touch()
    options = {"path": str(log), "per_call": 1, "hold": str(hold)}
    consumer = {"kind": "python", "class": "tests.test_delivery:Recorder", "options": options}
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=4)

    proc = start_daemon(config, err, env=child_env())
    try:
        wait_for(lambda: len(recorded(log)) >= 3, 60, "the consumer to be offered the same events again")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-2000:]
    held = [e for e in recorded(log) if "held" in e]
    assert held and all(e == {"held": held[0]["held"]} for e in held), "the same batch again, nothing taken"
    assert not events_of(recorded(log))
    assert len(cdc_links(node_dir)) == end.segment, "no link deleted: nothing committed"

    hold.unlink()
    log.unlink()
    proc = start_daemon(config, err, env=child_env())
    try:
        wait_for(lambda: len(events_of(recorded(log))) >= 15 and not cdc_links(node_dir), 60, "every event")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-2000:]
    assert events_of(recorded(log)) == ref


def realtime_node(node_dir: Path, log: Path, *, cdc_enabled: bool = False, **options: Any) -> Node:
    """A node whose realtime worker delivers to a ``Recorder``; without CDC links no daemon is needed."""
    consumer = {"kind": "python", "class": "tests.test_delivery:Recorder", "options": {"path": str(log), **options}}
    return Node.open(
        node_dir,
        realtime_cdc=True,
        realtime_consumer=consumer,
        cdc_enabled=cdc_enabled,
        wal_force_archive_timeout_ms=0,
        realtime_commit_record_interval_ms=0,
    )


def after_last_record(node: Node) -> WalPosition:
    """The position after the node's last data record (what a consumer that took everything commits)."""
    node.flush()
    last = None
    for ptr, rec in _records(node):
        if type(rec) is DataRecord:
            last = WalPosition(ptr.segment, ptr.offset, len(rec.entries))
    assert last is not None
    return last


def passed(node: Node, end: WalPosition) -> bool:
    """The realtime worker committed ``end`` (or beyond: the marker records after it)."""
    position = node.realtime.position
    return position is not None and position >= end


def _records(node: Node) -> Iterator[tuple[WalPointer, Any]]:
    return wal_records(Path(node.config.node_dir))


def test_realtime_one_event_per_call_sees_every_event_once_in_order(tmp_path: Path) -> None:
    """The node's realtime worker with a consumer that pulls one event per call: all 15 events exactly once, in WAL
    order, and its committed position ends after the last record."""
    node_dir, log = tmp_path / "node", tmp_path / "rt.jsonl"
    with realtime_node(node_dir, log, per_call=1) as node:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        write_mixed(node)
        end = after_last_record(node)
        wait_for(lambda: passed(node, end), 30, f"the realtime position to reach {end}")
    ref = reference(node_dir)
    assert len(ref) == 15
    assert events_of(recorded(log)) == ref


def test_realtime_stop_mid_record_hands_the_exact_rest_to_the_daemon(tmp_path: Path) -> None:
    """A realtime consumer taking one event per call fails at call 8 (inside the put_all record): the node stops with
    Stop(last) = the position after event 7, and the daemon delivers exactly events 8..15 from there."""
    node_dir, rt_log, d_log = tmp_path / "node", tmp_path / "rt.jsonl", tmp_path / "daemon.jsonl"
    with (
        realtime_node(node_dir, rt_log, cdc_enabled=True, per_call=1, fail_at=8) as node,
        Daemon(daemon_config(node_dir), Recorder(str(d_log), per_call=1)) as daemon,
    ):
        # The hand-over to the node: the daemon passes the TryStart record and deletes its link.
        wait_for(lambda: daemon.sync_once() >= 0 and node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        write_mixed(node)
        # Counted once its Stop record is durable (the mode says OFF before that record is written).
        wait_for(lambda: node.realtime.stops.get("consumer_error"), 30, "realtime to stop on the consumer failure")
        node.force_archive()
        wait_for(lambda: daemon.sync_once() >= 0 and len(events_of(recorded(d_log))) >= 8, 30, "the daemon's share")
        assert daemon.state.mode is CdcMode.DAEMON_ACTIVE
        assert daemon.sync_once() == 0
    ref = reference(node_dir)
    assert ref[7]["pos"][2] == 2, "event 8 is inside the put_all record"
    assert events_of(recorded(rt_log)) == ref[:7]
    assert events_of(recorded(d_log)) == ref[7:]


# --- 3. cdc_enabled = false ---------------------------------------------------------------------------
def write_secret_mix(node: Node) -> None:
    """Entries of ``public`` and of ``secret`` (CDC off): alone, a put_all of secret only, and a transaction that
    interleaves the two (its record comes out in two slices)."""
    public = node.cache("public")
    secret = node.cache("secret", cdc_enabled=False)
    public.put(1, "p1")
    secret.put(1, "s1")
    secret.put_all({2: "s2", 3: "s3"})
    with node.transaction() as tx:
        tx.put("public", 2, "p2")
        tx.put("secret", 4, "s4")
        tx.put("secret", 5, "s5")
        tx.put("public", 3, "p3")
        tx.put("secret", 6, "s6")
    public.put(4, "p4")


def write_secret_tail(node: Node) -> None:
    """Only entries of the secret cache: nothing to deliver, positions to pass."""
    secret = node.cache("secret")
    secret.put(7, "s7")
    secret.put_all({8: "s8", 9: "s9"})


@pytest.mark.parametrize("kind", ["iterate", "one_each", "jsonl"])
def test_daemon_never_delivers_a_cache_with_cdc_off(tmp_path: Path, kind: str) -> None:
    """No event of the secret cache reaches the consumer (iterating, one per call, or a sink reading slices), it is
    never announced (also not when the daemon restarts), nor destroyed, nor counted; a backlog of secret entries only
    still moves the committed position past them and its links are deleted."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        write_secret_mix(node)
        node.force_archive()
    ref = reference(node_dir, ["public"])
    assert len(ref) == 4 and len(reference(node_dir)) == 10
    out = tmp_path / "out.jsonl"

    def consumer() -> Consumer:
        if kind == "jsonl":
            return JsonlConsumer(out, fsync=False)
        return Recorder(str(out), per_call=1 if kind == "one_each" else 0)

    secret_before = {op: events_metric("secret", op) for op in ("create", "update", "delete")}
    end = end_of_wal(node_dir)
    with Daemon(daemon_config(node_dir), consumer()) as daemon:
        assert daemon.sync_once() == 4
        assert daemon.state.position == end
    assert events_of(recorded(out)) == ref
    if kind != "jsonl":
        assert [e for e in recorded(out) if "pos" not in e] == [{"caches": ["public"]}]

    # Only secret entries, then the secret cache destroyed: nothing delivered, the position moves on.
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        write_secret_tail(node)
        node.destroy_cache("secret")
        node.force_archive()
    end = end_of_wal(node_dir)
    with Daemon(daemon_config(node_dir), consumer()) as daemon:
        assert daemon.sync_once() == 0
        assert daemon.state.position == end
        assert cdc_links(node_dir) == {}
    assert events_of(recorded(out)) == ref
    if kind != "jsonl":
        # The restart announces the known caches: public only; the destroy of secret is not told.
        assert [e for e in recorded(out) if "pos" not in e] == [{"caches": ["public"]}, {"caches": ["public"]}]
    assert {op: events_metric("secret", op) for op in secret_before} == secret_before


def test_daemon_jsonl_skips_cdc_off_entries_inside_big_transactions(tmp_path: Path) -> None:
    """Entries of a cache with CDC off inside big mixed transactions (batches of thousands of events) never reach
    the jsonl file."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0, wal_segment_size_bytes=8 << 20) as node:
        node.cache("public")
        node.cache("secret", cdc_enabled=False)
        for t in range(2):
            with node.transaction() as tx:
                for k in range(6000):
                    tx.put("secret" if k % 4 == 3 else "public", t * 10_000 + k, {"k": k})
        node.force_archive()
    ref = reference(node_dir, ["public"])
    assert len(ref) == 9000
    out = tmp_path / "out.jsonl"
    consumer = JsonlConsumer(out, fsync=False)
    with Daemon(daemon_config(node_dir), consumer) as daemon:
        assert daemon.sync_once() == 9000
    assert events_of(recorded(out)) == ref


def test_realtime_never_delivers_a_cache_with_cdc_off(tmp_path: Path) -> None:
    """The node's realtime worker: no secret event, no announcement or destroy of the secret cache, and its position
    moves past a run of secret-only records."""
    node_dir, log = tmp_path / "node", tmp_path / "rt.jsonl"
    with realtime_node(node_dir, log) as node:
        wait_for(lambda: node.realtime.mode is RealtimeMode.ON, 30, "realtime on")
        write_secret_mix(node)
        end = after_last_record(node)
        wait_for(lambda: passed(node, end), 30, f"the realtime position to reach {end}")
        write_secret_tail(node)
        end = after_last_record(node)
        wait_for(lambda: passed(node, end), 30, f"the realtime position to pass the secret tail ({end})")
        assert node.destroy_cache("secret")
        node.cache("public").put(5, "p5")
        end = after_last_record(node)
        wait_for(lambda: passed(node, end), 30, f"the realtime position to reach {end}")
    ref = reference(node_dir, ["public"])
    assert len(ref) == 5
    lines = recorded(log)
    assert events_of(lines) == ref
    assert [e for e in lines if "pos" not in e] == [{"caches": ["public"]}]


def test_resend_of_a_cache_with_cdc_off_fails_clearly(tmp_path: Path) -> None:
    """``resend`` of a cache with CDC off is refused (nothing written to the WAL): the API raises, the control CLI
    exits 1 with one line naming the cache and the setting."""
    node_dir = tmp_path / "node"
    # No periodic checkpoint record and no segment roll may land in between (a slow run takes longer
    # than either interval).
    with Node.open(node_dir, checkpoint_interval_ms=3_600_000, wal_force_archive_timeout_ms=0) as node:
        write_secret_mix(node)
        node.flush()
        before = node.wal_position
        with pytest.raises(ValueError, match=r"^cache 'secret' has cdc_enabled = false"):
            node.resend("secret")
        res = subprocess.run(
            [*CDCD, "control", "--node-dir", str(node_dir), "resend", "--cache", "secret"],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        assert res.returncode == 1, res
        assert res.stdout == ""
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and "cache 'secret' has cdc_enabled = false" in lines[0], res.stderr
        node.flush()
        assert node.wal_position == before, "nothing was written"
        assert node.resend("public") == 4


def _data(cache_id: int, *keys: int) -> DataRecord:
    v = CacheVersion(1, 1, 1, 1)
    return DataRecord(tuple(DataEntry(cache_id, Op.CREATE, _raw(k), _raw(k), 0, v) for k in keys), 1)


def _raw(k: int) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(k))


def test_processor_follows_a_cache_whose_cdc_setting_changes() -> None:
    """A CREATE record of a known cache with another config changes it from there on: entries written while CDC is
    off are left out (positions still pass them), the switch off is recorded quietly, the switch on announced."""
    on, off = CacheConfig(cdc_enabled=True), CacheConfig(cdc_enabled=False)
    p = Processor(
        mode=CdcMode.DAEMON_ACTIVE,
        position=None,
        caches={},
        source_node="n",
        batch_max_events=1000,
        batch_max_bytes=1 << 20,
    )
    recs = [
        CacheRecord(7, "c", CacheOp.CREATE, on),
        _data(7, 1, 2),
        CacheRecord(7, "c", CacheOp.CREATE, off),
        _data(7, 3),
        CacheRecord(7, "c", CacheOp.CREATE, on),
        _data(7, 4),
        CacheRecord(7, "c", CacheOp.CREATE, off),
        CacheRecord(7, "c", CacheOp.DESTROY, off),
    ]
    items: list[Any] = []
    for i, rec in enumerate(recs):
        items += p.feed(WalPointer(0, i * 100), rec, 10)
    items.append(p.close_batch())
    changes = [(len(c.created), c.quiet, c.destroyed) for c in items if isinstance(c, CacheChange)]
    assert changes == [(1, False, []), (1, True, []), (1, False, []), (1, True, []), (0, False, [])]
    keys = [[ev.key for ev in b.events] for b in items if isinstance(b, Batch) and len(b.events)]
    assert keys == [[1, 2], [4]]
    assert p.position == WalPosition(0, 700, 1)


def test_lake_verify_leaves_out_a_cache_with_cdc_off(tmp_path: Path) -> None:
    """`cdcd lake verify` does not expect a cache with CDC off in the lake (it never gets there)."""
    from tests.support.delta_tables import change, compacted_lake

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    compacted_lake(lake, [change("public", "1", '"p1"', 1)])
    with Node.open(node_dir) as node:
        node.cache("public").put(1, "p1")
        node.cache("secret", cdc_enabled=False).put(1, "s1")
    res = subprocess.run(
        [*CDCD, "lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "secret" not in res.stdout
