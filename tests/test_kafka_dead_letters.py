"""Kafka dead letters (issue 31 item 8) against a real broker: changes whose message is over the topic's
``max.message.bytes`` go to ``<topic>.dlq`` in the same transaction as their batch; a SIGKILL right after a Kafka
commit holding one (before the daemon's own commit) sends nothing twice; every other change is in the topic exactly
once. With dead letters off the same change stops the daemon with one line naming its position."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

from tests.support.config import write_daemon_config
from tests.support.dead_letters import TOPIC_LIMIT, create_limited_topic, node_with_big_values
from tests.support.kafka import Broker, kafka_broker, positions_of, read_topic
from tests.support.procs import cdcd, child_env, error_lines, start_daemon, wait_for

__all__ = ["kafka_broker"]  # the fixture, used by name


def _stored_position(broker: Broker, node_dir: Path) -> tuple[int, int, int] | None:
    from cdcd.kafka.offsets import read_position

    node_id = (node_dir / "node_id").read_text().strip()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    if "cdcd-offsets" not in admin.list_topics(timeout=30).topics:
        return None
    return read_position({"bootstrap.servers": broker.bootstrap}, "cdcd-offsets", 1, node_id, 60)


def test_messages_over_max_message_bytes_go_to_the_dlq_topic_exactly_once(kafka_broker: Broker, tmp_path: Path):
    node_dir = tmp_path / "node"
    events, big = node_with_big_values(node_dir)
    topic = "dl"
    create_limited_topic(kafka_broker, topic)
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic": topic,
        "topic_partitions": 4,
        "batch_size_bytes": 16384,  # librdkafka's batches stay under the topic's limit
        "dead_letters": "on",
    }
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=400)
    err = tmp_path / "kill.err"
    # dies right after the first Kafka commit (it holds the first dead letter), before the daemon's own
    proc = start_daemon(config, err, {**child_env(), "CDCD_FAILPOINTS": "kafka.committed@1"})
    assert proc.wait(120) == -signal.SIGKILL, err.read_text()[-2000:]
    err = tmp_path / "run.err"
    proc = start_daemon(config, err)
    last = tuple(events[-1]["pos"])
    try:
        wait_for(lambda: _stored_position(kafka_broker, node_dir) == last or proc.poll() is not None, 120, "catch-up")
        assert proc.poll() is None, err.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, err.read_text()[-2000:]
    assert error_lines(err) == []

    got = [pos for ps in positions_of(read_topic(kafka_broker.bootstrap, topic)).values() for pos in ps]
    refused = [tuple(e["pos"]) for e in big]
    assert sorted(got) == sorted(tuple(e["pos"]) for e in events if tuple(e["pos"]) not in refused), "the rest once"
    dlq = [m for ms in read_topic(kafka_broker.bootstrap, f"{topic}.dlq").values() for m in ms]
    letters = [json.loads(m.value()) for m in dlq]
    assert [tuple(d["pos"]) for d in letters] == refused, "the refused changes exactly once, in order"
    for d, e, m in zip(letters, big, dlq, strict=True):
        assert (d["cache"], d["op"], d["topic"]) == ("c", e["op"], topic)
        assert d["error"].startswith("a message of ") and f"over the {TOPIC_LIMIT} bytes topic dl takes" in d["error"]
        assert d["key"] == {"cache": "c", "key": e["key"]} and json.loads(m.key()) == d["key"]
        assert d["value"]["after"]["pad"] == e["value"]["pad"] and d["value"]["source"]["entry_index"] == e["pos"][2]


def test_with_dead_letters_off_the_daemon_stops_naming_the_position(kafka_broker: Broker, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    events, big = node_with_big_values(node_dir)
    topic = "dl-off"
    create_limited_topic(kafka_broker, topic)
    consumer = {"kind": "kafka", "bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "topic_partitions": 4}
    consumer["batch_size_bytes"] = 16384
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=400)
    res = cdcd("run", "--config", str(config), timeout=120)
    assert res.returncode == 4, res.stderr[-2000:]
    first = big[0]
    position = "{}:{}#{}".format(*first["pos"])
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("cdcd: error:")]
    assert line.startswith(f"cdcd: error: consumer refused the event at {position} (cache c): a message of "), line
    assert line.endswith(
        f"bytes is over the {TOPIC_LIMIT} bytes topic {topic} takes (its max.message.bytes, at most "
        'max_message_bytes) (set [consumer] dead_letters = "on" to set such events aside)'
    ), line
    got = [pos for ps in positions_of(read_topic(kafka_broker.bootstrap, topic)).values() for pos in ps]
    assert sorted(got) == [tuple(e["pos"]) for e in events if tuple(e["pos"]) < tuple(first["pos"])]
