"""Monitoring figures of issue 31 item 5 against the real parts: the lake sink's, scraped from a real `cdcd run`
(deltalake writer, no Spark; a lake that turns read-only for a moment counts commit failures, one per retry step;
the files-per-partition gauge equals the count in the Delta snapshot), and the Kafka sink's transaction aborts
against the real broker."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from prometheus_client import REGISTRY

from cdcd import metrics
from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from tests.support.dead_letters import create_limited_topic, node_with_big_values
from tests.support.delta_lake import lake_consumer
from tests.support.kafka import Broker, kafka_broker, read_topic
from tests.support.lake import caught_up, position, write_config
from tests.support.metrics import try_samples
from tests.support.mounts import remount, tmpfs
from tests.support.ports import free_port
from tests.support.procs import reap, start_daemon, stop_daemon, wait_for
from tests.support.wal import wal_events
from tests.support.writer import make_node

__all__ = ["kafka_broker"]  # the fixture, used by name


def files_per_partition_max(lake: Path) -> int:
    adds = pa.table(DeltaTable(str(lake / "changes")).get_add_actions(flatten=True))
    keys = [c for c in adds.column_names if c.startswith("partition.")]
    return max(adds.group_by(keys).aggregate([([], "count_all")]).column("count_all").to_pylist())


def test_lake_commit_failures_and_files_per_partition_from_a_running_daemon(tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    n = make_node(node_dir, segments=3, tx_per_segment=20)
    port = free_port()
    with tmpfs(tmp_path / "mnt", "size=64m") as mnt:
        lake = mnt / "lake"
        config = write_config(
            tmp_path / "cdcd.toml",
            node_dir,
            lake_consumer(lake, retry_timeout_s=120),
            metrics_address=f"127.0.0.1:{port}",
            batch_max_events=200,
        )
        err = tmp_path / "run.err"
        proc = start_daemon(config, err)
        try:

            def scrape() -> dict[str, float]:
                assert proc.poll() is None, err.read_text()[-3000:]
                return try_samples(port) or {}

            wait_for(lambda: position(config) == caught_up(node_dir), 60, "the backlog landed")
            m = scrape()
            assert m["cdcd_lake_commit_failures_total"] == 0
            assert m["cdcd_lake_rows_written_total"] == len(wal_events(node_dir))
            assert m["cdcd_lake_files_per_partition_max"] == files_per_partition_max(lake) > 1

            # read-only while new segments arrive: each attempt fails and is retried; writable again: all lands
            remount(mnt, "ro")
            make_node(node_dir, segments=2, tx_per_segment=20, first_tx=n)
            wait_for(lambda: scrape()["cdcd_lake_commit_failures_total"] >= 2, 60, "failed landings counted")
            remount(mnt, "rw")
            wait_for(lambda: position(config) == caught_up(node_dir), 60, "the new segments landed")
            m = scrape()
        finally:
            if proc.poll() is None:
                assert stop_daemon(proc) == 0, err.read_text()[-3000:]
            reap(proc)
    failures = m["cdcd_lake_commit_failures_total"]
    # every failed landing was a retry step of the daemon, and nothing landed twice
    assert failures >= 2 and m["cdcd_daemon_consumer_retries_total"] == failures
    assert m["cdcd_lake_rows_written_total"] == len(wal_events(node_dir))
    assert m["cdcd_lake_files_per_partition_max"] >= 2


def test_kafka_transaction_aborts_count_the_refused_batch(kafka_broker: Broker, tmp_path: Path) -> None:
    """A change over the topic's max.message.bytes (dead letters off) fails its batch's transaction: one abort is
    counted, and the transactions committed before it are not."""
    node_dir = tmp_path / "node"
    events, big = node_with_big_values(node_dir)
    topic = "aborts"
    create_limited_topic(kafka_broker, topic)
    metrics.export(metrics.KAFKA_SINK)

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    aborts, committed = sample("cdcd_kafka_transaction_aborts_total"), sample("cdcd_kafka_transactions_total")
    sink = KafkaSink.from_options(
        {"bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "topic_partitions": 4}, "consumer"
    )
    with (
        pytest.raises(Exception, match="refused the event"),
        Daemon(DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=400), sink) as daemon,
    ):
        while daemon.sync_once():
            pass
    assert sample("cdcd_kafka_transaction_aborts_total") - aborts == 1
    sent = sum(1 for ms in read_topic(kafka_broker.bootstrap, topic).values() for m in ms if m.value() is not None)
    assert sent == sum(1 for e in events if tuple(e["pos"]) < tuple(big[0]["pos"])) > 0
    assert sample("cdcd_kafka_transactions_total") - committed >= 1
