"""Kafka topic names (issue 47 item 6): with ``topic_prefix`` no cache's topic is another cache's,
another cache's dead letters' or one of the sink's own topics, also as Kafka compares names
(``.`` and ``_`` alike), and the answer depends on names and settings alone.

Against a real broker and real daemon processes: caches ``x`` (with changes too large for its
topic, dead letters on), ``x.dlq``, ``a_b`` and, created later, ``a.b``, ``transaction`` (with
``transaction_metadata`` on) and an ordinary ``plain``, through a SIGKILL right after a Kafka
commit: every topic holds exactly its own cache's changes, once each."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from cdcd.config import ConfigError
from cdcd.kafka.errors import KafkaSetupError
from cdcd.kafka.options import KafkaSinkOptions
from cdcd.kafka.sink import KafkaSink
from cdcd.kafka.topics import TopicNameError, cache_of, cache_topic, dlq_topic, fold, sink_topics, suffix_of
from cdcd.node import Node
from tests.support.config import write_daemon_config
from tests.support.delta_lake import wal_batch
from tests.support.kafka import Broker, kafka_broker, positions_of, read_topic
from tests.support.procs import child_env, error_lines, log_events, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events

__all__ = ["kafka_broker"]  # the fixture, used by name

TOPIC_LIMIT = 65536
# names made of the characters that matter: separators Kafka folds, hex digits, the dead-letter suffix
NAMES = st.text(alphabet="ab._-12fdlqé ", min_size=1, max_size=10)


def _options(**more: Any) -> KafkaSinkOptions:
    return KafkaSinkOptions.load({"bootstrap_servers": "k:9092", "topic_prefix": "p", **more}, "consumer")


# the sink's own topics inside the caches' name space: caches a and 1 get their first byte escaped
PREFIXED = _options(transaction_metadata=True, metadata_topic="p.a", offsets_topic="p.1_dlq")


@given(NAMES)
def test_a_topic_is_valid_dotless_and_gives_back_its_cache(name: str) -> None:
    topic = cache_topic(PREFIXED, name).topic
    suffix = topic.removeprefix("p.")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", suffix), suffix
    assert cache_of(suffix) == name


def _neighbours(name: str) -> st.SearchStrategy[str]:
    """Names whose plain topics would fold like ``name``'s or its dead letters' (``.`` and ``_``
    swapped, a ``.dlq``/``_dlq`` tail), and any other name."""
    swapped = st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda flips: "".join({".": "_", "_": "."}.get(c, c) if f else c for c, f in zip(name, flips, strict=True))
    )
    return st.one_of(swapped, st.sampled_from([f"{name}.dlq", f"{name}_dlq", name.removesuffix(".dlq")]), NAMES)


@given(st.data())
def test_no_topic_folds_like_another_caches_topic_or_dead_letters(data: st.DataObject) -> None:
    a = data.draw(NAMES)
    b = data.draw(_neighbours(a))
    ta, tb = cache_topic(PREFIXED, a).topic, cache_topic(PREFIXED, b).topic
    assert (fold(ta) == fold(tb)) == (a == b)
    assert fold(ta) != fold(dlq_topic(tb)) and fold(tb) != fold(dlq_topic(ta))  # whichever names, the same too
    assert fold(ta) not in sink_topics(PREFIXED) and fold(dlq_topic(ta)) not in sink_topics(PREFIXED)


def test_the_sinks_own_topics_are_avoided_in_the_property_above() -> None:
    assert [cache_topic(PREFIXED, n).topic for n in ("a", "1", "a.dlq", "b")] == ["p._61", "p._31", "p.a_2edlq", "p.b"]


def test_ordinary_names_keep_their_topic_and_the_others_are_escaped() -> None:
    kept = ["orders", "order_items", "SQL_PUBLIC_ORDERS", "a-b", "X_DLQ", "dlq", "Transaction"]
    assert [suffix_of(n) for n in kept] == kept
    escaped = {"a.b": "a_2eb", "x.dlq": "x_2edlq", "x_dlq": "x_5fdlq", "x_1f": "x_5f1f", "b c": "b_20c", "é": "_c3_a9"}
    assert {n: suffix_of(n) for n in escaped} == escaped
    assert fold(f"p.{suffix_of('a.b')}") != fold(f"p.{suffix_of('a_b')}")


def test_a_cache_named_like_one_of_the_sinks_topics_gets_its_first_byte_escaped() -> None:
    assert cache_topic(_options(transaction_metadata=True), "transaction") == ("p._74ransaction", "transaction_topic")
    assert cache_topic(_options(), "transaction") == ("p.transaction", "")  # no transaction topic: its own
    opts = _options(metadata_topic="p.orders_dlq", offsets_topic="p.x")
    assert cache_topic(opts, "orders") == ("p._6frders", "metadata_topic")  # its dead letters' would be it
    assert cache_topic(opts, "x") == ("p._78", "offsets_topic")
    assert cache_topic(opts, "y") == ("p.y", "")
    assert cache_of("_6frders") == "orders"
    # a name whose escaped form is the configured one: nothing left to map it to
    with pytest.raises(TopicNameError) as err:
        cache_topic(_options(metadata_topic="p._c3_a9"), "é")
    assert str(err.value) == (
        "key 'metadata_topic': cache 'é': its topic p._c3_a9 or its dead letters' p._c3_a9.dlq would be the "
        "metadata_topic (Kafka takes '.' and '_' alike in topic names): give metadata_topic another name"
    )


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (
            {"topic": "t", "offsets_topic": "t_dlq"},
            "consumer: key 'offsets_topic': t_dlq collides with the dead letters of topic t.dlq (Kafka takes '.' "
            "and '_' alike in topic names): give offsets_topic another name",
        ),
        (
            {"topic_prefix": "m.x", "offsets_topic": "m_x"},
            "consumer: key 'offsets_topic': m_x collides with metadata_topic m.x (Kafka takes '.' and '_' alike "
            "in topic names): give offsets_topic another name",
        ),
        (
            {
                "topic_prefix": "p",
                "transaction_metadata": True,
                "transaction_topic": "p_offsets",
                "offsets_topic": "p.offsets",
            },
            "consumer: key 'transaction_topic': p_offsets collides with offsets_topic p.offsets (Kafka takes '.' "
            "and '_' alike in topic names): give transaction_topic another name",
        ),
    ],
)
def test_sink_topics_that_fold_alike_are_a_config_error(options: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        KafkaSinkOptions.load({"bootstrap_servers": "k:9092", **options}, "consumer")
    assert str(err.value) == line


# --- against a broker ---------------------------------------------------------------------------------


def _stored_position(broker: Broker, node_dir: Path) -> tuple[int, int, int] | None:
    from cdcd.kafka.offsets import read_position

    node_id = (node_dir / "node_id").read_text().strip()
    if "cdcd-offsets" not in AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=30).topics:
        return None
    return read_position({"bootstrap.servers": broker.bootstrap}, "cdcd-offsets", 1, node_id, 60)


def _write(node_dir: Path, caches: list[str], first: int, count: int, big: set[int]) -> None:
    """``count`` puts to each of ``caches`` (keys from ``first``), one cache after another in
    batches of 25; keys in ``big`` of cache ``x`` get a value over the topic's limit."""
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        for name in caches:
            node.cache(name)
        for i in range(first, first + count, 25):
            for name in caches:
                rows: dict[int, Any] = {k: {"k": k, "c": name} for k in range(i, i + 25)}
                if name == "x":
                    for k in big & rows.keys():
                        rows[k] = {"k": k, "pad": "".join(f"{n:08x}" for n in range(k, k + 12_500))}
                node.cache(name).put_all(rows)
        node.force_archive()


def _run_to(config: Path, err: Path, broker: Broker, node_dir: Path) -> None:
    last = tuple(wal_events(node_dir)[-1]["pos"])
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: proc.poll() is not None or _stored_position(broker, node_dir) == last, 120, "catch-up")
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc, 60)
    assert rc == 0, err.read_text()[-3000:]
    assert error_lines(err) == []


def test_colliding_cache_names_each_get_their_own_topic_exactly_once(kafka_broker: Broker, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    prefix = "tn"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    # x's topic takes less than its big changes: those become dead letters in tn.x.dlq
    made = admin.create_topics([NewTopic(f"{prefix}.x", 2, 1, config={"max.message.bytes": str(TOPIC_LIMIT)})])
    made[f"{prefix}.x"].result(30)
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic_prefix": prefix,
        "topic_partitions": 2,
        "transaction_metadata": True,
        "batch_size_bytes": 16384,  # librdkafka's batches stay under the topic's limit
        "dead_letters": "on",
    }
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=200)

    # first x, x.dlq, a_b and plain, delivered
    _write(node_dir, ["x", "x.dlq", "a_b", "plain"], 0, 150, big={30})
    _run_to(config, tmp_path / "run1.err", kafka_broker, node_dir)
    # then a.b and transaction appear; the daemon dies right after its first Kafka commit (before
    # its own), and starts again
    _write(node_dir, ["a.b", "transaction", "x", "x.dlq", "a_b", "plain"], 1000, 150, big={1040})
    err = tmp_path / "killed.err"
    proc = start_daemon(config, err, {**child_env(), "CDCD_FAILPOINTS": "kafka.committed@1"})
    assert proc.wait(120) == -signal.SIGKILL, err.read_text()[-3000:]
    _run_to(config, tmp_path / "run2.err", kafka_broker, node_dir)

    events = wal_events(node_dir)
    big = [e for e in events if "pad" in e["value"]]
    assert [(e["cache"], e["key"]) for e in big] == [("x", 30), ("x", 1040)]
    topic_of = {
        "x": "tn.x",
        "x.dlq": "tn.x_2edlq",
        "a_b": "tn.a_b",
        "a.b": "tn.a_2eb",
        "plain": "tn.plain",
        "transaction": "tn._74ransaction",
    }
    counts = {"x": 298, "x.dlq": 300, "a_b": 300, "a.b": 150, "plain": 300, "transaction": 150}
    names = {t for t in admin.list_topics(timeout=30).topics if t == prefix or t.startswith(f"{prefix}.")}
    assert names == {*topic_of.values(), "tn", "tn.transaction", "tn.x.dlq"}
    for cache, topic in topic_of.items():
        parts = read_topic(kafka_broker.bootstrap, topic)
        got = sorted(pos for ps in positions_of(parts).values() for pos in ps)  # a list: a duplicate shows
        want = sorted(tuple(e["pos"]) for e in events if e["cache"] == cache and "pad" not in e["value"])
        assert len(want) == counts[cache] and got == want, topic
        values = [json.loads(m.value()) for ms in parts.values() for m in ms]
        assert {v["source"]["cache"] for v in values} == {cache}
        assert {v["after"]["c"] for v in values} == {cache}
    dead = [json.loads(m.value()) for ms in read_topic(kafka_broker.bootstrap, "tn.x.dlq").values() for m in ms]
    assert [(d["cache"], d["topic"], tuple(d["pos"])) for d in dead] == [("x", "tn.x", tuple(e["pos"])) for e in big]
    tx = [json.loads(m.value()) for ms in read_topic(kafka_broker.bootstrap, "tn.transaction").values() for m in ms]
    assert tx and {v["status"] for v in tx} == {"BEGIN", "END"}
    # every start that met the cache named like the transaction topic said so in one line
    renamed = [
        line
        for name in ("killed.err", "run2.err")
        for line in log_events(tmp_path / name)
        if line.get("event") == "kafka_topic_escaped"
    ]
    assert [(r["cache"], r["topic"]) for r in renamed] == [("transaction", "tn._74ransaction")] * 2
    assert renamed[0]["reason"] == "tn.transaction would fold like the transaction_topic"


def test_a_foreign_topic_that_folds_like_a_caches_topic_is_named_in_one_line(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    """cdcd names no two of its topics alike; a topic it did not make (or a dotted cache's topic
    from before 0.2.0) can still hold the folded name: Kafka refuses the cache's topic and the
    line says which topic is in the way and what to do."""
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    admin.create_topics([NewTopic("fo.a.b", 1, 1)])["fo.a.b"].result(30)
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        node.cache("a_b").put(1, 1)
        node_id = node.node_id
        node.force_archive()
    sink = KafkaSink.from_options({"bootstrap_servers": kafka_broker.bootstrap, "topic_prefix": "fo"}, "consumer")
    sink.start(REGISTRY)
    try:
        with pytest.raises(KafkaSetupError) as err:
            sink.on_events(wal_batch(node_dir, str(node_id)))
    finally:
        sink.stop()
    line = str(err.value)
    assert line.startswith("consumer: key 'topic_prefix': cannot create topic fo.a_b: "), line
    assert "collides with existing topic: fo.a.b" in line and line.endswith(
        "(Kafka takes '.' and '_' alike in topic names; cdcd names no two of its topics so: that one is not this "
        "sink's, or is a dotted cache's topic from before cdcd 0.2.0: delete it once read)"
    ), line
    assert "\n" not in line
