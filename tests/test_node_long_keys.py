"""Keys longer than LMDB's 511-byte limit: the page store keeps them hashed with the full key
beside the value, so every path (puts, removes, transactions, checkpoints, recovery, TTL expiry,
scans, replicated apply and the daemon's delivery) works up to ``MAX_KEY_BYTES``; beyond it a
write is refused with one line naming the limit and nothing reaches the WAL.

Before the hashing, a key of about 505 bytes or more was accepted by ``put`` and made the next
checkpoint fail with ``MDB_BAD_VALSIZE`` at every open: the node refused writes for good."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node import Node
from cdcd.node.writes import MAX_KEY_BYTES
from cdcd.replication.applier import apply_replicated
from cdcd.replication.protocol import Apply, ReplEntry
from cdcd.replication.resolver import ConflictResolver
from cdcd.replication.server import RequestRefused
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.wal.records import CacheVersion, Op
from tests.support.wal import wal_events

# Around LMDB's limit (the expiry index puts 8 bytes before a key), and well past it.
SIZES = [1, 490, 495, 496, 497, 503, 504, 505, 511, 512, 4096, MAX_KEY_BYTES - 3]


def long_key(size: int, tag: str = "k") -> str:
    """A string key whose MessagePack encoding is exactly ``size`` bytes (str8/16/32 headers)."""
    header = 1 if size <= 32 else 2 if size <= 256 else 3 if size <= 65_538 else 5
    return (tag * size)[: size - header]


def test_long_key_helper_is_exact() -> None:
    assert [len(msgspec.msgpack.encode(long_key(s))) for s in SIZES] == SIZES


def test_long_keys_survive_checkpoints_reopen_and_removes(node_dir: Path) -> None:
    keys = {s: long_key(s) for s in SIZES}
    with Node.open(node_dir, checkpoint_interval_ms=3_600_000) as n:
        c = n.cache("c")
        for s, k in keys.items():
            c.put(k, {"size": s})
        with n.transaction() as tx:
            tx.put("c", long_key(600, "t"), "in a transaction")
            tx.remove("c", keys[4096])
        c.put_all({long_key(700, "a"): 1, long_key(701, "a"): 2})
        assert n.checkpoint() is not None  # failed with MDB_BAD_VALSIZE before
        c.put(keys[512], "updated after the checkpoint")
        c.remove(keys[505])
        assert n.checkpoint() is not None
        n._store.renew_reader()
        stored = {msgspec.msgpack.decode(k) for k, _ in n._store.items(c.cache_id)}
        assert keys[512] in stored
        assert keys[505] not in stored
        assert keys[4096] not in stored
    expected = {k: {"size": s} for s, k in keys.items() if s not in (505, 4096)}
    expected[keys[512]] = "updated after the checkpoint"
    expected |= {long_key(600, "t"): "in a transaction", long_key(700, "a"): 1, long_key(701, "a"): 2}
    with Node.open(node_dir) as n:
        c = n.cache("c")
        assert dict(c.items()) == expected
        for k, v in expected.items():
            assert c.get(k) == v
        # Writes go on after the reopen (they were refused for good before).
        c.put(keys[MAX_KEY_BYTES - 3], "again")
        assert c.remove(keys[511]) is True
        assert c.get(keys[511]) is None
    with Node.open(node_dir) as n:
        assert n.cache("c").get(keys[MAX_KEY_BYTES - 3]) == "again"
        assert len(n.cache("c")) == len(expected) - 1


def test_a_key_over_the_limit_is_refused_and_never_written(node: Node, node_dir: Path) -> None:
    c = node.cache("c")
    too_long = long_key(MAX_KEY_BYTES + 1)
    for write in (
        lambda: c.put(too_long, 1),
        lambda: c.put_all({too_long: 1, "short": 2}),
        lambda: c.remove(too_long),
    ):
        with pytest.raises(ValueError, match=rf"^cache 'c': key is {MAX_KEY_BYTES + 1} bytes encoded, over the limit"):
            write()
    with pytest.raises(ValueError, match="over the limit of"), node.transaction() as tx:
        tx.put("c", too_long, 1)
    c.put("after", 1)
    node.force_archive()
    assert [e["key"] for e in wal_events(node_dir)] == ["after"]


def test_long_keys_expire_through_the_index(node_dir: Path) -> None:
    with Node.open(node_dir, checkpoint_interval_ms=3_600_000, ttl_expire_interval_ms=3_600_000) as n:
        c = n.cache("c")
        short, long_ = long_key(10), long_key(2000)
        c.put(short, 1, ttl_ms=50)
        c.put(long_, 2, ttl_ms=50)
        c.put(long_key(3000), 3)
        n.checkpoint()
        time.sleep(0.06)  # the TTL itself is wall-clock time: this waits for the expire time to pass
        assert n.expire_entries() == 2
        n.checkpoint()
        assert dict(c.items()) == {long_key(3000): 3}
        assert n._store.expiry_rows() == 0
    deletes = [e["key"] for e in wal_events(node_dir) if e["op"] == "delete"]
    assert sorted(deletes) == sorted([short, long_])


def test_long_keys_reach_the_daemon_and_a_replica(tmp_path: Path) -> None:
    src_dir, dst_dir, out = tmp_path / "a", tmp_path / "b", tmp_path / "events.jsonl"
    keys = [long_key(s) for s in (504, 1000, MAX_KEY_BYTES - 3)]
    with Node.open(src_dir, wal_force_archive_timeout_ms=0) as a:
        c = a.cache("c")
        for i, k in enumerate(keys):
            c.put(k, i)
        a.checkpoint()
        assert a.resend("c") == 3  # the resend scans the store: the full keys come back
        a.force_archive()
    with Daemon(DaemonConfig(node_dir=str(src_dir), metrics_address=""), JsonlConsumer(out)) as daemon:
        assert daemon.sync_once() == 6
    lines = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert [o["key"] for o in lines] == keys + keys

    entries = [
        ReplEntry(
            Op.UPDATE,
            msgspec.Raw(msgspec.msgpack.encode(k)),
            msgspec.Raw(msgspec.msgpack.encode(i)),
            CacheVersion(i + 1, 1, 2, 1),
        )
        for i, k in enumerate(keys)
    ]
    with Node.open(dst_dir, cluster_id=1) as b:
        reply = apply_replicated(b, Apply(1, "c", entries), ConflictResolver(1))
        assert reply.applied == 3
        b.checkpoint()
        assert dict(b.cache("c").items()) == {k: i for i, k in enumerate(keys)}
        too_long = ReplEntry(
            Op.UPDATE,
            msgspec.Raw(msgspec.msgpack.encode(long_key(MAX_KEY_BYTES + 1))),
            msgspec.Raw(msgspec.msgpack.encode(0)),
            CacheVersion(9, 1, 2, 1),
        )
        with pytest.raises(RequestRefused, match="over the limit of"):
            apply_replicated(b, Apply(2, "c", [too_long]), ConflictResolver(1))
