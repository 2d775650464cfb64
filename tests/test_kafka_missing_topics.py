"""Topics that do not exist, against a real broker (docs/kafka.md): `cdcd kafka-to-node` refuses a missing metadata
topic with one line naming it (Ignite's kafka-to-ignite: "Unknown topic") unless `--no-metadata`, and then applies
the topic exactly; a missing data topic is named as such; a topic deleted under a running `cdcd run` with the Kafka
sink stops it with one line naming the topic, not as Kafka "failing"."""

from __future__ import annotations

import signal
from pathlib import Path

from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from tests.support.config import write_daemon_config
from tests.support.kafka import Broker, kafka_broker
from tests.support.kafka_to_node import Applier, node_diff_rc
from tests.support.procs import error_lines, reap, start_daemon, wait_for
from tests.support.replication_rig import NodeProc, Procs, procs
from tests.support.writer import make_node

__all__ = ["kafka_broker", "procs"]  # fixtures, used by name


def delete_topic(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result()
    wait_for(lambda: topic not in admin.list_topics(timeout=10).topics, 60, f"topic {topic} gone")


def fill_topic(bootstrap: str, node_dir: Path, topic: str) -> None:
    """Node A's WAL into ``topic`` through the sink (which makes ``<topic>.metadata`` too)."""
    sink = KafkaSink.from_options({"bootstrap_servers": bootstrap, "topic": topic, "topic_partitions": 2}, "consumer")
    with Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address=""), sink) as daemon:
        while daemon.sync_once():
            pass


def last_line(app: Applier) -> str:
    lines = app.runs[-1].read_text().splitlines()
    assert lines and "Traceback" not in app.runs[-1].read_text(), app.tail()
    return lines[-1]


def test_kafka_to_node_refuses_a_missing_metadata_topic_unless_no_metadata(
    kafka_broker: Broker, tmp_path: Path, procs: Procs
) -> None:
    a_dir = tmp_path / "a"
    make_node(a_dir, 2, 20, cluster_id=1)
    fill_topic(kafka_broker.bootstrap, a_dir, "nometa")
    delete_topic(kafka_broker.bootstrap, "nometa.metadata")
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    app = Applier(
        procs,
        tmp_path,
        "k2n",
        bootstrap_servers=kafka_broker.bootstrap,
        topic="nometa",
        target=b.target,
        token_file=str(b.token),
    )
    proc = app.start()
    assert proc.wait(120) == 1, app.tail()
    assert last_line(app) == (
        f"cdcd: error: {app.config}: key 'metadata_topic': topic 'nometa.metadata' does not exist on "
        f"{kafka_broker.bootstrap} (the sink creates it; --no-metadata runs without it)"
    )
    assert node_diff_rc(a_dir, b) == 1, "nothing applied"

    proc = app.start("--no-metadata")
    wait_for(lambda: node_diff_rc(a_dir, b) == 0 or proc.poll() is not None, 180, "B equal to A")
    assert proc.poll() is None, app.tail()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, app.tail()


def test_kafka_to_node_names_a_missing_data_topic(kafka_broker: Broker, tmp_path: Path, procs: Procs) -> None:
    b = NodeProc(procs, tmp_path, "b", 2)
    b.start()
    app = Applier(
        procs,
        tmp_path,
        "k2n",
        bootstrap_servers=kafka_broker.bootstrap,
        topic="never-made",
        target=b.target,
        token_file=str(b.token),
    )
    proc = app.start()
    assert proc.wait(120) == 1, app.tail()
    assert last_line(app) == (
        f"cdcd: error: {app.config}: key 'topic': topic 'never-made' does not exist on {kafka_broker.bootstrap}"
    )


def test_a_topic_deleted_under_the_running_sink_is_named(kafka_broker: Broker, tmp_path: Path) -> None:
    node_dir, err = tmp_path / "node", tmp_path / "daemon.err"
    make_node(node_dir, 1, 10, cluster_id=1)
    consumer = {
        "kind": "kafka",
        "bootstrap_servers": kafka_broker.bootstrap,
        "topic": "deleted",
        "topic_partitions": 2,
        "retry_timeout_s": 60,
    }
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 120, "the daemon")
        wait_for(lambda: b"segment_done" in err.read_bytes() or proc.poll() is not None, 120, "a delivery")
        assert proc.poll() is None, err.read_text()[-3000:]
        delete_topic(kafka_broker.bootstrap, "deleted")
        make_node(node_dir, 1, 10, first_tx=10, cluster_id=1)
        assert proc.wait(120) == 4, err.read_text()[-3000:]
    finally:
        reap(proc)
    (line,) = error_lines(err)
    assert f"key 'topic': topic 'deleted' does not exist on {kafka_broker.bootstrap}" in line, line
    assert "bootstrap_servers" not in line and "failing" not in line
