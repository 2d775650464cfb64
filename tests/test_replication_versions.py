"""Versions ordered as Ignite's GridCacheVersion.compareTo, and a source node that goes back in its
WAL (re-created from scratch, restored from a backup, restarted) replicated to a real endpoint.

The convergence tests run real nodes, B's real replication endpoint and a real daemon with the
replication consumer; A's WAL is the reference: B must hold exactly what A wrote last, and B's
replicated entries must carry A's versions as their origins.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import msgspec
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.node.node import Node
from cdcd.node.topology import next_topology_version
from cdcd.node.writes import key_hash
from cdcd.replication.client import ReplicationClient
from cdcd.replication.protocol import ReplEntry
from cdcd.replication.resolver import ConflictResolver, Held, Rule, Verdict
from cdcd.sinks import load_consumer
from cdcd.sinks.replication import ReplicationConsumer
from cdcd.wal.records import CacheVersion, DataEntry, Op
from tests.support.replication_rig import (
    NODE_SETTINGS,
    DaemonProc,
    NodeProc,
    Procs,
    node_data,
    node_diff,
    origin,
    procs,
    split_entries,
    stop_all,
    wait_caught_up,
)
from tests.support.wal import wal_records

__all__ = ["procs"]  # a fixture, used by name

TOKEN = "replication-token-0123456789abcdef"
_key = msgspec.msgpack.Encoder(order="deterministic").encode
_val = msgspec.msgpack.Encoder().encode


# --- the order itself ----------------------------------------------------------------------------
def ignite_compare(a: CacheVersion, b: CacheVersion) -> int:
    """A direct model of GridCacheVersion.compareTo: topology version, then order, then node order."""
    if a.topology_version == b.topology_version:
        if a.order == b.order:
            if a.node_order == b.node_order:
                return 0
            return -1 if a.node_order < b.node_order else 1
        return -1 if a.order < b.order else 1
    return -1 if a.topology_version < b.topology_version else 1


_small = st.integers(0, 4)  # small ranges: equal fields, where the later fields decide, come up often
_versions = st.builds(
    CacheVersion,
    order=st.one_of(_small, st.integers(0, 2**63 - 1)),
    node_order=st.one_of(_small, st.integers(0, 2**31 - 1)),
    cluster_id=st.integers(1, 31),
    topology_version=st.one_of(_small, st.integers(0, 2**62)),
)


@settings(max_examples=2000, deadline=None)
@given(a=_versions, b=_versions)
def test_comparison_is_ignites(a: CacheVersion, b: CacheVersion) -> None:
    """Every comparison operator agrees with the model; cluster id takes no part (as DR id in Ignite)."""
    c = ignite_compare(a, b)
    assert (a < b, a <= b, a > b, a >= b) == (c < 0, c <= 0, c > 0, c >= 0)


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(_versions, max_size=30))
def test_sorting_a_sequence_matches_the_model(seq: list[CacheVersion]) -> None:
    """A sequence sorted by the struct's order is sorted by the model, and its maximum is the model's."""
    ordered = sorted(seq)
    assert all(ignite_compare(x, y) <= 0 for x, y in itertools.pairwise(ordered))
    if seq:
        top = max(seq)
        assert all(ignite_compare(top, v) >= 0 for v in seq)


@settings(max_examples=500, deadline=None)
@given(held_v=_versions, new_v=_versions)
def test_rule_3_follows_the_model(held_v: CacheVersion, new_v: CacheVersion) -> None:
    """Same origin cluster: the resolver takes the entry the model calls newer, rejects the older."""
    new_v = msgspec.structs.replace(new_v, cluster_id=held_v.cluster_id)
    receiver = 1 + held_v.cluster_id % 31  # another cluster
    got = ConflictResolver(receiver).resolve(
        "c", b"k", Held(_val(1), held_v), ReplEntry(Op.UPDATE, msgspec.Raw(b"\xa1k"), msgspec.Raw(_val(2)), new_v)
    )
    c = ignite_compare(new_v, held_v)
    if new_v == held_v:
        assert got.duplicate
    else:
        assert got == Verdict(c > 0, Rule.VERSION)


def v(order: int, topology: int, node: int = 1) -> CacheVersion:
    return CacheVersion(order, node, 1, topology)


def test_reorder_cases() -> None:
    """The cases Ignite orders by compareTo: within one topology the order decides whichever arrives
    first; a higher topology wins over any order; node order breaks a tie of both."""
    r = ConflictResolver(2)

    def verdict(held_v: CacheVersion, new_v: CacheVersion) -> bool:
        new = ReplEntry(Op.UPDATE, msgspec.Raw(_key("k")), msgspec.Raw(_val(0)), new_v)
        return r.resolve("c", _key("k"), Held(_val(0), held_v), new).use_new

    assert verdict(v(5, 1), v(6, 1)) and not verdict(v(6, 1), v(5, 1))  # reordered within a topology
    assert verdict(v(10, 1), v(1, 2))  # order restarted in a later topology: newer
    assert not verdict(v(1, 2), v(10, 1))  # a late arrival of the earlier topology: older
    assert verdict(v(5, 3, node=1), v(5, 3, node=2)) and not verdict(v(5, 3, node=2), v(5, 3, node=1))


def test_topology_version_of_an_open() -> None:
    """Restart: one above the last open even if the clock went back; fresh or restored: the clock."""
    assert next_topology_version(None, 1000) == 1000
    assert next_topology_version(5000, 1000) == 5001  # clock stepped back: still above the last open
    assert next_topology_version(999, 1000) == 1000  # a backup's old value: the clock is above it


# --- real nodes, a real endpoint, a real daemon ----------------------------------------------------
def _token(tmp: Path) -> Path:
    path = tmp / "token"
    if not path.exists():
        path.write_text(TOKEN + "\n")
        path.chmod(0o600)
    return path


def _open_b(tmp: Path) -> Node:
    return Node.open(tmp / "b", cluster_id=2, replication_listen="127.0.0.1:0", replication_token_file=str(_token(tmp)))


def _open_a(tmp: Path) -> Node:
    return Node.open(tmp / "a", cluster_id=1)


def _replicate(tmp: Path, a: Node, b: Node) -> ReplicationConsumer:
    """Everything A's CDC dir holds, sent to B by a daemon with the replication consumer."""
    a.force_archive()
    assert b.replication is not None
    consumer = load_consumer(
        {"kind": "replication", "target": f"127.0.0.1:{b.replication.port}", "token_file": str(_token(tmp))}
    ).consumer
    assert isinstance(consumer, ReplicationConsumer)
    with Daemon(DaemonConfig(node_dir=a.config.node_dir, metrics_address=""), consumer) as daemon:
        daemon.sync_once()
    return consumer


def _local_entries(node_dir: Path) -> list[DataEntry]:
    return [
        e
        for _p, r in wal_records(node_dir)
        for e in getattr(r, "entries", ())
        if e.version.other_cluster_version is None
    ]


def _origins_on_b(b: Node) -> list[CacheVersion]:
    b.force_archive()
    out = []
    for _p, r in wal_records(Path(b.config.node_dir)):
        for e in getattr(r, "entries", ()):
            assert e.version.other_cluster_version is not None
            out.append(e.version.other_cluster_version)
    return out


def _write(a: Node, values: list[str]) -> None:
    for value in values:
        a.cache("c").put("k", value)


def test_recreated_source_converges(tmp_path: Path) -> None:
    """A writes k ten times (replicated: B holds v1.9), is re-created in a fresh dir and writes k:
    B takes it (before: B kept v1.9, the new order 1 being below 10)."""
    b = _open_b(tmp_path)
    try:
        with _open_a(tmp_path) as a:
            _write(a, [f"v1.{i}" for i in range(10)])
            first = _replicate(tmp_path, a, b)
        assert (first.applied, first.rejected) == (10, 0) and b.cache("c").get("k") == "v1.9"
        old = _local_entries(tmp_path / "a")
        shutil.rmtree(tmp_path / "a")
        with _open_a(tmp_path) as a:
            _write(a, ["v2.0"])
            again = _replicate(tmp_path, a, b)
        new = _local_entries(tmp_path / "a")
        assert [e.version.order for e in new] == [1]
        assert all(e.version > o.version for e in new for o in old)
        assert (again.sent, again.applied, again.rejected) == (1, 1, 0)
        assert b.cache("c").get("k") == "v2.0"
        assert _origins_on_b(b) == [e.version for e in old + new]
    finally:
        b.close()


def test_restored_source_converges(tmp_path: Path) -> None:
    """A writes k four times, is backed up (node dir with its daemon state), writes six more
    (B: v1.9), is restored from the backup and writes k six times: B takes all six and ends on the
    last (before: B rejected all six and kept v1.9 for good)."""
    b = _open_b(tmp_path)
    backup = tmp_path / "backup"
    try:
        with _open_a(tmp_path) as a:
            _write(a, [f"v1.{i}" for i in range(4)])
            _replicate(tmp_path, a, b)
        shutil.copytree(tmp_path / "a", backup)
        with _open_a(tmp_path) as a:
            _write(a, [f"v1.{i}" for i in range(4, 10)])
            _replicate(tmp_path, a, b)
        assert b.cache("c").get("k") == "v1.9"
        lost = _local_entries(tmp_path / "a")
        shutil.rmtree(tmp_path / "a")
        shutil.copytree(backup, tmp_path / "a")
        with _open_a(tmp_path) as a:
            _write(a, [f"v2.{i}" for i in range(6)])
            after = _replicate(tmp_path, a, b)
        history = _local_entries(tmp_path / "a")
        restored = history[4:]
        assert [e.version.order for e in restored] == list(range(5, 11))  # the orders the lost history used
        assert all(e.version > o.version for e in restored for o in lost)
        assert (after.sent, after.applied, after.rejected) == (6, 6, 0)
        assert b.cache("c").get("k") == "v2.5"
        assert _origins_on_b(b) == [e.version for e in lost + restored]
    finally:
        b.close()


def test_restarts_grow_the_topology_and_a_fresh_dir_starts_above_them(tmp_path: Path) -> None:
    """Every open writes with a higher topology version than the one before, even many opens in a
    row; a node re-created right after them still starts above (each open is a millisecond or more)."""
    b = _open_b(tmp_path)
    try:
        tops = []
        for i in range(12):
            with _open_a(tmp_path) as a:
                tops.append(a.writes.topology_version)
                _write(a, [f"open {i}"])
        assert tops == sorted(set(tops))
        with _open_a(tmp_path) as a:
            consumer = _replicate(tmp_path, a, b)
        assert (consumer.applied, consumer.rejected) == (12, 0) and b.cache("c").get("k") == "open 11"
        entries = _local_entries(tmp_path / "a")
        assert [e.version.topology_version for e in entries] == tops
        shutil.rmtree(tmp_path / "a")
        with _open_a(tmp_path) as a:
            assert a.writes.topology_version > tops[-1]
            _write(a, ["fresh"])
            consumer = _replicate(tmp_path, a, b)
        assert (consumer.applied, consumer.rejected) == (1, 0) and b.cache("c").get("k") == "fresh"
    finally:
        b.close()


def test_rejections_log_a_key_hash_not_the_key(tmp_path: Path) -> None:
    """A change from an earlier open of the origin node is rejected with a warning naming the key by
    its hash; rule 5 lines too. Neither carries the key or a value unless log_keys is on (which is
    warned at start)."""
    secret = {"card": "4111-1111-1111-1111"}
    key_raw = _key(secret)

    def send(node: Node, entries: list[ReplEntry]) -> None:
        assert node.replication is not None
        with ReplicationClient(("127.0.0.1", node.replication.port), TOKEN.encode()) as client:
            client.connect()
            client.apply_all([("c", entries)])

    def entry(value: Any, version: CacheVersion) -> ReplEntry:
        return ReplEntry(Op.UPDATE, msgspec.Raw(key_raw), msgspec.Raw(_val(value)), version)

    for log_keys in (False, True):
        with structlog.testing.capture_logs() as logs:
            node = Node.open(
                tmp_path / f"b{log_keys}",
                cluster_id=2,
                replication_listen="127.0.0.1:0",
                replication_token_file=str(_token(tmp_path)),
                log_keys=log_keys,
            )
            try:
                send(node, [entry("value-1", CacheVersion(1, 1, 1, 500))])
                send(node, [entry("value-2", CacheVersion(9, 1, 1, 400))])  # rule 3: older open
                send(node, [entry("value-3", CacheVersion(0, 1, 1, 500))])  # rule 3: no warning
                send(node, [entry("value-4", CacheVersion(1, 1, 3, 900))])  # rule 5
                assert node.cache("c").get(secret) == "value-1"
            finally:
                node.close()
        warned = [e for e in logs if e["log_level"] == "warning"]
        events = [e["event"] for e in warned]
        assert events == (["log_keys_on"] if log_keys else []) + [
            "replication_older_open_rejected",
            "replication_conflict_unresolved",
        ]
        older = warned[-2]
        assert older["held_version"] == "cluster 1 node 1 order 1 topology 500"
        assert older["new_version"] == "cluster 1 node 1 order 9 topology 400"
        for line in warned[-2:]:
            if log_keys:
                assert line["key"] == repr(secret) and "key_hash" not in line
            else:
                assert line["key_hash"] == key_hash(key_raw) and "key" not in line
                assert "4111" not in repr(line) and "value-" not in repr(line)


# --- the larger run of the issue, with processes ----------------------------------------------------
def test_restored_source_process_converges_key_by_key(tmp_path: Path, procs: Procs) -> None:
    """`cdcd node run` A and B, `cdcd run` replicating A to B: A's 200 keys written ten times, A's
    node dir (with its daemon state) restored from a backup of the first round, the 200 keys
    written again. B takes every one of them (before: 100 of 200 such keys stayed stale), node diff
    says same, and B's replicated entries carry exactly A's versions of both histories."""
    n = 200
    a = NodeProc(procs, tmp_path, "a", 1, listen=False)
    b = NodeProc(procs, tmp_path, "b", 2)
    daemon = DaemonProc(procs, tmp_path, a, b)
    backup = tmp_path / "backup"

    def write_rounds(rounds: list[str]) -> None:
        with Node.open(a.dir, cluster_id=1, **NODE_SETTINGS) as node:
            for r in rounds:
                node.cache("c").put_all({k: f"{r}:{k}" for k in range(n)})
            node.force_archive()

    def replicate() -> None:
        a.start()
        daemon.start()
        wait_caught_up((a, daemon))
        stop_all(daemon, a)

    b.start()
    write_rounds(["v1.0"])
    replicate()
    shutil.copytree(a.dir, backup)
    write_rounds([f"v1.{i}" for i in range(1, 10)])
    replicate()
    lost = split_entries(a)[0]
    assert node_diff(a, b)[0] == 0 and node_data(a)["c"] == {k: f"v1.9:{k}" for k in range(n)}
    shutil.rmtree(a.dir)
    shutil.copytree(backup, a.dir)
    write_rounds(["v2.0"])
    replicate()
    received = b.received()
    rc, live = node_diff(a, b)
    assert rc == 0, live
    b.stop()

    restored = split_entries(a)[0][n:]
    assert len(restored) == n and all(e.version > o.version for e in restored for o in lost)
    assert node_data(b)["c"] == node_data(a)["c"] == {k: f"v2.0:{k}" for k in range(n)}
    assert [origin(e) for e in split_entries(b)[1]] == [e.version for e in lost + restored]
    assert received == {
        "local": 0,
        "new": n,
        "version": 10 * n,
        "field": 0,
        "unresolved": 0,
        "duplicate": 0,
        "rejected": 0,
    }
