"""Three brokers (KRaft, each also a controller), replication factor 3: the leader of a data
partition SIGKILLed mid-stream while the daemon sends under load; nothing lost, nothing twice."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.support.config import write_daemon_config
from tests.support.kafka import Cluster, kafka_cluster, positions_of, read_topic
from tests.support.procs import start_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import start_writer, writer_count

__all__ = ["kafka_cluster"]

# Three JVMs and a leader fail-over take about three minutes on a busy 2-core box: outside
# `make test`, run by `make test-kafka-cluster`.
pytestmark = pytest.mark.skipif(
    not os.environ.get("CDCD_KAFKA_CLUSTER"), reason="three brokers: run with `make test-kafka-cluster`"
)


def _stored(cluster: Cluster, node_dir: Path) -> tuple[int, int, int] | None:
    from cdcd.kafka.offsets import read_position

    node_id = (node_dir / "node_id").read_text().strip()
    pos = read_position({"bootstrap.servers": cluster.bootstrap}, "cdcd-offsets", 1, node_id, 60)
    return pos


def _leader(cluster: Cluster, topic: str, partition: int) -> int:
    meta = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(topic, timeout=30)
    return int(meta.topics[topic].partitions[partition].leader)


@pytest.mark.slow
def test_partition_leader_sigkilled_mid_stream(kafka_cluster: Cluster, tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    topic = "rf3"
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_cluster.bootstrap,
        "topic": topic,
        "topic_partitions": 4,
        "replication_factor": 3,
        "max_events_per_transaction": 1000,
        "retry_timeout_s": 120,
    }
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=1000)
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=200)
    wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 60, "the node's cdc dir")
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: b"kafka_producer_ready" in err.read_bytes() or proc.poll() is not None, 120, "a producer")
        assert proc.poll() is None, err.read_text()[-3000:]
        wait_for(lambda: (_stored(kafka_cluster, node_dir) or (0, 0, 0)) > (0, 0, 0), 60, "first commits")
        victim = kafka_cluster.broker(_leader(kafka_cluster, topic, 0))
        victim.stop(kill=True)
        before = _stored(kafka_cluster, node_dir)
        wait_for(lambda: _stored(kafka_cluster, node_dir) != before, 120, "commits without the old leader")
        assert proc.poll() is None, err.read_text()[-3000:]
        victim.start()
        time.sleep(1.0)  # more load with the broker back (not a synchronisation)
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-2000:]
    try:
        assert writer_count(tmp_path) > 0
        events = wal_events(node_dir)
        last = tuple(events[-1]["pos"])
        wait_for(lambda: _stored(kafka_cluster, node_dir) == last or proc.poll() is not None, 300, "catch-up")
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(60)
    parts = positions_of(read_topic(kafka_cluster.bootstrap, topic))
    got = [pos for ps in parts.values() for pos in ps]
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} duplicates"
    assert set(got) == {tuple(e["pos"]) for e in events}
    for p, ps in parts.items():
        assert ps == sorted(ps), f"partition {p} out of WAL order"
