"""The node's Python API: caches, transactions, versions, recovery and configuration."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import msgspec
import pytest
import structlog

from cdcd.config import ConfigError, load_toml
from cdcd.node import Node, NodeConfig
from cdcd.node.node import NodeLocked
from cdcd.wal import CacheOp, CacheRecord, Checkpoint, DataRecord, Op, SegmentEnd, WalReader
from cdcd.wal.segment import list_segments


def wal_records(node_dir: Path) -> list:
    work, _ = list_segments(node_dir / "wal")
    active = max(work) if work else None
    return [r for _, r in WalReader([node_dir / "wal" / "archive", node_dir / "wal"], active_segment=active)]


def abandon(n: Node) -> None:
    """Stop a node like a crash after its last flush: no final checkpoint, no clean close."""
    n._stop.set()
    n._checkpoint_wake.set()
    n._checkpointer.join()
    n._wal.close()
    n._store.close()
    n._metastorage.close()
    n._control_server.stop()  # a dead process serves no socket
    n._dir_lock.release()


def data_entries(node_dir: Path) -> list:
    return [e for r in wal_records(node_dir) if isinstance(r, DataRecord) for e in r.entries]


def test_put_get_remove_and_ops_in_wal(node: Node, node_dir: Path) -> None:
    """put/get/remove behave like a map and the WAL records CREATE, UPDATE and DELETE in order."""
    orders = node.cache("orders")
    orders.put("k", {"qty": 1})
    orders.put("k", {"qty": 2})
    assert orders.get("k") == {"qty": 2}
    assert "k" in orders
    assert orders.remove("k") is True
    assert orders.remove("k") is False  # nothing written for a missing key
    assert orders.get("k") is None and orders.get("k", "dflt") == "dflt"
    node.flush()
    entries = data_entries(node_dir)
    assert [e.op for e in entries] == [Op.CREATE, Op.UPDATE, Op.DELETE]
    assert [e.decoded_value() for e in entries] == [{"qty": 1}, {"qty": 2}, None]
    assert all(e.decoded_key() == "k" for e in entries)


def test_key_and_value_types(node: Node) -> None:
    """Keys and values of every msgspec-encodable kind round-trip; dict keys compare by content."""
    c = node.cache("mixed")
    samples = {1: 1.5, "s": b"bytes", b"b": [1, "x", None], (1, 2): {"a": {"b": [True]}}, -7: False}
    for k, v in samples.items():
        c.put(k, v)
    for k, v in samples.items():
        assert c.get(list(k) if isinstance(k, tuple) else k) == v
    c.put({"b": 1, "a": 2}, "dictkey")
    assert c.get({"a": 2, "b": 1}) == "dictkey"
    with pytest.raises(ValueError, match="must not be None"):
        c.put("x", None)


def test_keys_and_values_nested_too_deep_to_read_back_are_refused(node: Node, node_dir: Path) -> None:
    """A key or value nested deeper than MAX_NESTING (which readers could not decode) is refused with the cache's name,
    in put and in a transaction, and nothing reaches the WAL; exactly MAX_NESTING levels are accepted and read back."""
    from cdcd.node.writes import MAX_NESTING

    def nested(depth: int) -> object:
        value: object = 0
        for _ in range(depth):
            value = [value]
        return value

    c = node.cache("deep")
    c.put("ok", nested(MAX_NESTING))
    assert c.get("ok") == nested(MAX_NESTING)
    with pytest.raises(ValueError, match=f"cache 'deep': value nests deeper than {MAX_NESTING} levels"):
        c.put("bad", nested(MAX_NESTING + 1))
    with pytest.raises(ValueError, match="cache 'deep': key nests deeper"):
        c.put(tuple(nested(MAX_NESTING + 1)), 1)
    with pytest.raises(ValueError, match="value nests deeper"), node.transaction() as tx:
        tx.put("deep", "t1", 1)
        tx.put("deep", "t2", {"a": nested(MAX_NESTING + 5)})
    assert c.get("bad") is None and c.get("t1") is None
    node.flush()
    data = [r for r in wal_records(node_dir) if isinstance(r, DataRecord)]
    assert [msgspec.msgpack.decode(e.key) for r in data for e in r.entries] == ["ok"], "only the accepted put"


def test_resend_under_concurrent_writes_never_puts_a_stale_value_last(node: Node, node_dir: Path) -> None:
    """While a thread writes every key once more (a new value, or a remove), `resend` runs: applying the cache's WAL
    entries in WAL order ends exactly at the node's state (no resent value lands after a newer write of its key)."""
    c = node.cache("hot")
    for first in range(0, 20_000, 500):  # records must fit the fixture's 64 KiB segments
        c.put_all({k: 0 for k in range(first, first + 500)})

    def writer() -> None:
        for k in range(20_000):  # in key order, like resend: they overtake each other
            if k % 7 == 0:
                c.remove(k)
            else:
                c.put(k, f"new-{k}")

    t = threading.Thread(target=writer)
    t.start()
    try:
        sent = [node.resend("hot")]
    finally:
        t.join()
    assert sent[0] > 10_000
    node.flush()
    state: dict[object, object] = {}
    records = wal_records(node_dir)
    cache_id = next(r.cache_id for r in records if isinstance(r, CacheRecord) and r.name == "hot")
    for r in records:
        if isinstance(r, DataRecord):
            for e in r.entries:
                if e.cache_id != cache_id:
                    continue
                key = msgspec.msgpack.decode(e.key)
                if e.op == Op.DELETE:
                    state.pop(key, None)
                else:
                    state[key] = msgspec.msgpack.decode(e.value)
    assert state == dict(c.items())


def test_versions_partitions_and_cache_records(node: Node, node_dir: Path) -> None:
    """Every entry gets a strictly increasing version order and a stable partition; caches are WAL records."""
    c = node.cache("p", partitions=16)
    c.put_all({i: i for i in range(50)})
    node.flush()
    records = wal_records(node_dir)
    creates = [r for r in records if isinstance(r, CacheRecord)]
    assert creates[0].name == "p" and creates[0].op == CacheOp.CREATE and creates[0].config.partitions == 16
    entries = data_entries(node_dir)
    orders = [e.version.order for e in entries]
    assert orders == sorted(orders) and len(set(orders)) == 50
    enc = msgspec.msgpack.Encoder(order="deterministic")
    assert all(e.partition == zlib.crc32(enc.encode(e.decoded_key())) % 16 for e in entries)
    assert all(e.version.cluster_id == 1 and e.version.node_order == 1 for e in entries)


def test_put_all_and_remove_all_are_one_record(node: Node, node_dir: Path) -> None:
    """put_all and remove_all write one DataRecord each; remove_all skips absent keys."""
    c = node.cache("bulk")
    c.put_all({i: str(i) for i in range(10)})
    assert c.remove_all([1, 2, 3, 99]) == 3
    node.flush()
    data = [r for r in wal_records(node_dir) if isinstance(r, DataRecord)]
    assert [len(r.entries) for r in data] == [10, 3]
    assert len(c) == 7


def test_transaction_commits_atomically_and_rolls_back(node: Node, node_dir: Path) -> None:
    """A transaction over two caches is one DataRecord; an exception inside discards every write."""
    node.cache("users").put("u", 1)
    with node.transaction() as tx:
        tx.put("orders", 1, "a")
        tx.remove("users", "u")
        assert tx.get("orders", 1) == "a" and tx.get("users", "u") is None
    with pytest.raises(RuntimeError), node.transaction() as tx:
        tx.put("orders", 2, "b")
        raise RuntimeError("abort")
    assert node.cache("orders").get(1) == "a"
    assert node.cache("orders").get(2) is None
    assert node.cache("users").get("u") is None
    node.flush()
    data = [r for r in wal_records(node_dir) if isinstance(r, DataRecord)]
    assert [[e.op for e in r.entries] for r in data] == [[Op.CREATE], [Op.CREATE, Op.DELETE]]


def test_reopen_recovers_without_checkpoint(node_dir: Path) -> None:
    """Data written and never checkpointed (killed before close) comes back by WAL replay."""
    n = Node.open(node_dir, checkpoint_interval_ms=3_600_000)
    c = n.cache("c")
    for i in range(100):
        c.put(i, {"v": i})
    c.remove(5)
    abandon(n)
    with structlog.testing.capture_logs() as logs:
        n2 = Node.open(node_dir)
    try:
        opened = next(e for e in logs if e["event"] == "node_opened")
        assert opened["records_replayed"] >= 102 and opened["checkpoint"] is None
        c2 = n2.cache("c")
        assert c2.get(5) is None and c2.get(99) == {"v": 99} and len(c2) == 99
        c2.put(100, "after")  # versions continue above the replayed ones
        n2.flush()
        orders = [e.version.order for e in data_entries(node_dir)]
        assert orders == sorted(orders) and len(set(orders)) == len(orders)
    finally:
        n2.close()


def test_checkpoint_bounds_replay(node_dir: Path) -> None:
    """After a checkpoint, reopening replays only what followed it."""
    with Node.open(node_dir, checkpoint_interval_ms=3_600_000) as n:
        c = n.cache("c")
        c.put_all({i: i for i in range(1000)})
        ptr = n.checkpoint()
        assert ptr is not None
        c.put("late", 1)
        assert n.checkpoint() is not None
        assert n.checkpoint() is None  # nothing changed since
    with structlog.testing.capture_logs() as logs, Node.open(node_dir) as n:
        opened = next(e for e in logs if e["event"] == "node_opened")
        # Only the Checkpoint record written at close, and the end of the segment close() rolled.
        assert opened["records_replayed"] == 2
        assert len(n.cache("c")) == 1001


def test_checkpoint_writes_exactly_the_live_rows(node_dir: Path) -> None:
    """A checkpoint mixing puts, updates and removes leaves LMDB holding exactly the live rows,
    with each row's newest value and version (no WAL replay involved: read straight from LMDB)."""
    with Node.open(node_dir, checkpoint_interval_ms=3_600_000) as n:
        c = n.cache("c")
        c.put_all({i: i for i in range(300)})
        n.checkpoint()
        for i in range(0, 300, 3):
            c.remove(i)
        for i in range(1, 300, 3):
            c.put(i, -i)
        c.put_all({i: i for i in range(300, 350)})
        c.remove(301)
        n.checkpoint()
        n._store.renew_reader()
        stored = {msgspec.msgpack.decode(k): v for k, v in n._store.items(c.cache_id)}
        expected = {i: (-i if i % 3 == 1 and i < 300 else i) for i in range(350) if i % 3 and i != 301}
        expected |= {i: i for i in range(300, 350, 3)}
        assert {k: msgspec.msgpack.decode(v.value) for k, v in stored.items()} == expected
        assert stored[1].version.order > stored[2].version.order  # the update's own version
        assert all(v.expire_time_ms == 0 for v in stored.values())


def test_torn_active_tail_is_truncated_on_open(node_dir: Path) -> None:
    """Garbage appended to the active segment (a torn write) is cut off on open and logged; data survives."""
    n = Node.open(node_dir)
    n.cache("c").put_all({i: i for i in range(10)})
    abandon(n)  # a clean close would roll the segment into the archive: crash with data in it
    work, _ = list_segments(node_dir / "wal")
    active = work[max(work)]
    good = active.read_bytes()
    with open(active, "ab") as f:
        f.write(b"\x30\x00\x00\x00\x01\xde\xad\xbe\xef" + b"\x01" * 20)  # a frame cut short
    with structlog.testing.capture_logs() as logs, Node.open(node_dir) as n:
        assert next(e for e in logs if e["event"] == "wal_tail_truncated")["bytes_dropped"] == 29
        # The node may append its own records right after opening: the good part stays, the torn frame is gone.
        after = active.read_bytes()
        torn_header = b"\x30\x00\x00\x00\x01\xde\xad\xbe\xef"
        assert after[: len(good)] == good and after[len(good) : len(good) + 9] != torn_header
        assert len(n.cache("c")) == 10
        n.cache("c").put("more", 1)
    assert [type(r) for r in wal_records(node_dir)][-3:] == [DataRecord, Checkpoint, SegmentEnd]


def test_destroy_cache_and_recreate(node: Node, node_dir: Path) -> None:
    """A destroyed cache loses its data (also across reopen) and a new cache of that name starts empty."""
    c = node.cache("tmp")
    c.put_all({i: i for i in range(20)})
    node.checkpoint()
    c.put(100, 100)
    assert node.destroy_cache("tmp") is True
    assert node.destroy_cache("tmp") is False
    with pytest.raises(ValueError, match="destroyed"):
        c.put(1, 1)
    c2 = node.cache("tmp")
    assert len(c2) == 0 and c2.get(1) is None
    c2.put("new", 1)
    node.flush()
    ops = [(r.op, r.name) for r in wal_records(node_dir) if isinstance(r, CacheRecord)]
    assert ops == [(CacheOp.CREATE, "tmp"), (CacheOp.DESTROY, "tmp"), (CacheOp.CREATE, "tmp")]


def test_destroyed_cache_stays_destroyed_after_replay(node_dir: Path) -> None:
    """Replay of create, data, destroy, recreate (no checkpoint between) ends with only the new data."""
    n = Node.open(node_dir, checkpoint_interval_ms=3_600_000)
    n.cache("t").put_all({i: i for i in range(5)})
    n.destroy_cache("t")
    n.cache("t").put("x", 1)
    n.flush()
    abandon(n)
    with Node.open(node_dir) as n2:
        assert list(n2.cache("t").items()) == [("x", 1)]


def test_background_mode_and_threads(node_dir: Path) -> None:
    """Eight threads writing concurrently in background mode lose nothing and versions stay unique."""
    with Node.open(node_dir, wal_mode="background", wal_segment_size_bytes=256 * 1024) as n:
        c = n.cache("c")

        def work(t: int) -> None:
            for i in range(500):
                c.put((t, i), i)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(c) == 4000
    entries = data_entries(node_dir)
    assert len(entries) == 4000
    orders = [e.version.order for e in entries]
    assert orders == sorted(orders)  # WAL order == version order


def test_second_open_fails_naming_pid(node: Node, node_dir: Path) -> None:
    """Opening an open node dir fails at once with the holder's pid."""
    with pytest.raises(NodeLocked, match=f"locked by pid {os.getpid()}"):
        Node.open(node_dir)


def test_bad_settings_name_the_key(tmp_path: Path) -> None:
    """Unknown or out-of-range settings fail with one line naming the key."""
    with pytest.raises(ConfigError, match="unknown key 'wal_segmnt_size_bytes'"):
        Node.open(tmp_path, wal_segmnt_size_bytes=1)
    with pytest.raises(ConfigError, match="key 'wal_mode'"):
        Node.open(tmp_path, wal_mode="sometimes")
    with pytest.raises(ConfigError, match="key 'cluster_id': out of range: 40"):
        Node.open(tmp_path, cluster_id=40)


def test_config_file_unknown_key(tmp_path: Path) -> None:
    """A TOML file with an unknown key is refused naming the file and the key."""
    p = tmp_path / "node.toml"
    p.write_text('node_dir = "x"\nwal_flush_intervl_ms = 5\n')
    with pytest.raises(ConfigError, match=r"node\.toml: unknown key 'wal_flush_intervl_ms'"):
        load_toml(p, NodeConfig)


def test_example_config_loads() -> None:
    """config/node.toml (the shipped example) is valid."""
    cfg = load_toml(Path(__file__).parent.parent / "config" / "node.toml", NodeConfig)
    assert cfg.wal_mode == "fsync" and cfg.node_dir == "var/node1"


def test_force_archive(node: Node, node_dir: Path) -> None:
    """force_archive rolls a segment holding records into the archive (and links it), and does nothing otherwise."""
    node.cache("c").put(1, 1)
    seg = node.force_archive()
    assert seg is not None
    assert (node_dir / "wal" / "archive" / f"{seg:016d}.wal").exists()
    assert (node_dir / "cdc" / f"{seg:016d}.wal").exists()
    assert node.force_archive() is None
    records = [r for _, r in WalReader([node_dir / "cdc"])]
    assert isinstance(records[-1], SegmentEnd)
