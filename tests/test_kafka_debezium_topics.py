"""Debezium's layout against a real broker: one topic per cache (``topic_prefix``) with names
Kafka refuses escaped, the row's key columns as message key, and the transaction topic's
BEGIN/END records matching the events' ``transaction`` blocks, also when node transactions are
cut across Kafka transactions and each part is sent by a new producer (the counts continue
from the stored position)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from cdcd.consumer import EventBatch
from cdcd.kafka.sink import KafkaSink
from cdcd.kafka.topics import cache_of, suffix_of
from cdcd.node import Node
from tests.support.delta_lake import wal_batch
from tests.support.kafka import Broker, kafka_broker, read_topic

__all__ = ["kafka_broker"]


@given(st.text(min_size=1, max_size=60))
def test_topic_suffix_is_valid_and_reversible(name: str) -> None:
    suffix = suffix_of(name)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", suffix)
    assert cache_of(suffix) == name


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_topic_suffixes_never_collide(a: str, b: str) -> None:
    assert (suffix_of(a) == suffix_of(b)) == (a == b)


def test_topic_suffix_examples() -> None:
    assert suffix_of("orders") == "orders" and suffix_of("order_items") == "order_items"
    assert suffix_of("b c") == "b_20c" and suffix_of("x_1f") == "x_5f1f" and suffix_of("é") == "_c3_a9"


def _values(broker: Broker, topic: str) -> list[tuple[Any, Any]]:
    msgs = [m for ms in read_topic(broker.bootstrap, topic).values() for m in ms]
    return [(json.loads(m.key()), json.loads(m.value())) for m in msgs if m.value() is not None]


def test_per_cache_topics_and_transaction_records(kafka_broker: Broker, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0, partitions=8) as node:
        a, bc, x = node.cache("a"), node.cache("b c"), node.cache("x_1f")
        with node.transaction() as tx:  # five events of two caches in one node transaction
            tx.put("a", 1, {"n": 1})
            tx.put("a", 2, {"n": 2})
            tx.put("b c", {"id": 7, "part": "p"}, "seven")  # a composite key, a non-record value
            tx.put("a", 3, {"n": 3})
            tx.put("b c", {"id": 8, "part": "p"}, "eight")
        a.put_all({4: {"n": 4}, 5: {"n": 5}, 6: {"n": 6}})
        a.remove(1)
        x.put("k", {"n": 0})
        bc.put({"id": 9, "part": "q"}, {"id": 100, "n": 9})  # a value column named like a key column
        node_id = node.node_id
        node.force_archive()
    options = {
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": "pc",
        "topic_partitions": 2,
        "transaction_metadata": True,
        "tombstones": False,
        "max_events_per_transaction": 2,
    }
    batch: EventBatch | None = wal_batch(node_dir, str(node_id))
    rounds = 0
    while batch is not None:  # a new producer for every Kafka transaction: state only in Kafka
        sink = KafkaSink.from_options(options, "consumer")
        sink.start(REGISTRY)
        try:
            assert sink.on_events(batch) is True
        finally:
            sink.stop()
        _taken, batch = batch.split_taken()
        rounds += 1
    assert rounds == 6  # 11 events, two per Kafka transaction

    topics = {"a": "pc.a", "b c": "pc.b_20c", "x_1f": "pc.x_5f1f"}
    events: list[tuple[str, Any, Any]] = [
        (cache, key, value) for cache, topic in topics.items() for key, value in _values(kafka_broker, topic)
    ]
    assert len(events) == 11
    db = str(node_id)
    for cache, key, v in events:
        assert v["source"]["table"] == cache and v["source"]["db"] == db and v["source"]["name"] == "pc"
        row = v["after"] if v["op"] != "d" else v["before"]
        assert {k: row[k] for k in key} == key  # the message key is the row's key columns
    keys = sorted(json.dumps(k, sort_keys=True) for c, k, _v in events if c == "b c")
    assert keys == ['{"id": 7, "part": "p"}', '{"id": 8, "part": "p"}', '{"id": 9, "part": "q"}']
    rows = {json.dumps(k, sort_keys=True): v["after"] for c, k, v in events if c == "b c"}
    assert rows['{"id": 7, "part": "p"}'] == {"id": 7, "part": "p", "value": "seven"}
    assert rows['{"id": 9, "part": "q"}'] == {"id": 9, "part": "q", "n": 9}  # the key's id wins
    deleted = [v for _c, _k, v in events if v["op"] == "d"]
    assert [(v["before"], v["after"]) for v in deleted] == [({"key": 1}, None)]

    # every node transaction: BEGIN and END once, END counting its events per data collection,
    # its events ranked 1..n overall and per collection
    by_tx: dict[str, list[tuple[str, Any]]] = {}
    for cache, _k, v in events:
        by_tx.setdefault(v["transaction"]["id"], []).append((cache, v["transaction"]))
    records = _values(kafka_broker, "pc.transaction")
    assert Counter((v["status"], v["id"]) for _k, v in records) == Counter(
        [("BEGIN", t) for t in by_tx] + [("END", t) for t in by_tx]
    )
    assert all(k == {"id": v["id"]} for k, v in records)
    for _k, v in records:
        blocks = by_tx[v["id"]]
        if v["status"] == "BEGIN":
            assert v["event_count"] is None and v["data_collections"] is None
            continue
        assert v["event_count"] == len(blocks)
        per_cache = Counter(f"{db}.{c}" for c, _b in blocks)
        assert {d["data_collection"]: d["event_count"] for d in v["data_collections"]} == per_cache
        assert sorted(b["total_order"] for _c, b in blocks) == list(range(1, len(blocks) + 1))
        for c in {c for c, _b in blocks}:
            orders = sorted(b["data_collection_order"] for cc, b in blocks if cc == c)
            assert orders == list(range(1, len(orders) + 1))
    assert sorted(len(b) for b in by_tx.values()) == [1, 1, 1, 3, 5]


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({}, "consumer: key 'topic': give topic (one topic for all caches) or topic_prefix (one per cache)"),
        (
            {"topic": "t", "topic_prefix": "p"},
            "consumer: key 'topic': give topic (one topic for all caches) or topic_prefix (one per cache), not both",
        ),
        ({"topic_prefix": "a b"}, "consumer: key 'topic_prefix': 'a b' is not a valid topic name"),
        (
            {"topic_prefix": "p", "transaction_metadata": True, "transaction_topic": "p"},
            "consumer: key 'metadata_topic': topic, metadata_topic, offsets_topic and transaction_topic must differ",
        ),
    ],
)
def test_topic_options_refused_in_one_line(options: dict[str, Any], line: str) -> None:
    from cdcd.config import ConfigError
    from cdcd.kafka.options import KafkaSinkOptions, KafkaToNodeOptions

    with pytest.raises(ConfigError) as err:
        KafkaSinkOptions.load({"bootstrap_servers": "k:9092", **options}, "consumer")
    assert str(err.value) == line
    with pytest.raises(ConfigError, match=r"key 'topic': give topic \(the sink's one topic\) or topic_prefix"):
        KafkaToNodeOptions.load({"bootstrap_servers": "k:9092", "target": "h:1", "token_file": "t"}, "k2n.toml")


def test_restored_node_continues_as_a_new_generation(kafka_broker: Broker, tmp_path: Path) -> None:
    """A node dir copied back from a backup reuses WAL positions Kafka already holds: its new
    entries go out as generation 1 (``source.generation``, transaction ids, the stored position),
    none skipped as already sent, while the entries it shares with the old history are not sent
    again."""
    import shutil

    from cdcd.daemon.config import DaemonConfig
    from cdcd.daemon.daemon import Daemon
    from cdcd.kafka.offsets import read_stored
    from tests.support.wal import wal_events

    node_dir, backup = tmp_path / "node", tmp_path / "backup"

    def write(tag: str, keys: range) -> None:
        with Node.open(node_dir, wal_force_archive_timeout_ms=0, partitions=8) as node:
            for k in keys:
                with node.transaction() as tx:
                    tx.put("c", k, {"tag": tag, "k": k})
                    tx.put("d", f"k{k}", tag)
            node.force_archive()

    def deliver() -> int:
        sink = KafkaSink.from_options({"bootstrap_servers": kafka_broker.bootstrap, "topic": "restore"}, "consumer")
        with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), sink) as daemon:
            n = 0
            while True:
                got = daemon.sync_once()
                if not got:
                    return n
                n += got

    write("a", range(0, 20))
    shutil.copytree(node_dir, backup)  # the backup: before anything was delivered
    write("b", range(20, 40))
    deliver()
    original = wal_events(node_dir)
    shutil.rmtree(node_dir)
    shutil.copytree(backup, node_dir)  # restored: the daemon's state too
    write("c", range(40, 50))
    deliver()
    write("d", range(50, 55))
    assert deliver() == 10  # after the switch, the new generation's position is the stored one
    restored = wal_events(node_dir)

    def expect(events: list[dict[str, Any]]) -> dict[tuple[int, int, int], Any]:
        return {tuple(e["pos"]): (e["cache"], e["key"], e["value"]) for e in events}

    shared = expect(original[:40])
    assert shared == expect(restored[:40])  # the backup's part: one history
    want = {0: expect(original), 1: expect(restored[40:])}
    got: dict[int, dict[tuple[int, int, int], Any]] = {0: {}, 1: {}}
    node_id = (node_dir / "node_id").read_text().strip()
    for key, v in _values(kafka_broker, "restore"):
        s = v["source"]
        pos = (s["segment"], s["offset"], s["entry_index"])
        assert pos not in got[s["generation"]], f"{pos} twice in generation {s['generation']}"
        value = {k: x for k, x in v["after"].items() if k != "key"}
        got[s["generation"]][pos] = (s["cache"], key["key"], value if s["cache"] == "c" else value["value"])
        prefix = f"{node_id}:g1:" if s["generation"] else f"{node_id}:"
        assert v["transaction"]["id"] == f"{prefix}{s['segment']}:{s['offset']}"
    assert got == want
    assert {tag for _c, _k, val in got[1].values() for tag in [val["tag"] if isinstance(val, dict) else val]} == {
        "c",
        "d",
    }
    stored = read_stored({"bootstrap.servers": kafka_broker.bootstrap}, "cdcd-offsets", 1, node_id, 60)
    assert stored is not None and stored.generation == 1 and stored.address == tuple(restored[-1]["pos"])
