"""cdcd -> Kafka: the daemon (in-process ``sync_once``) drains a backlog of 1000-entry transactions
with 100-byte values into a real local broker (scripts/kafka.sh) through the ``kafka`` sink,
exactly once (transactions + stored position), Debezium's envelope.

``python -m tests.bench.run --only 'kafka.*'``; needs ``make install`` (the broker's jars).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.kafka.sink import KafkaSink
from cdcd.node import Node
from cdcd.wal.segment import list_segments
from tests.support.bench import VALUE_100B, Bench, Measurement, Metric
from tests.support.kafka import LIBS, Broker, apply_topic_to_node

TX_SIZE = 1000
PARTITIONS = 16
NODE_SETTINGS: dict[str, Any] = {
    "wal_segment_size_bytes": 16 << 20,
    "wal_force_archive_timeout_ms": 0,
    "wal_mode": "background",
    "archive_max_bytes": 0,
    "partitions": 1024,
}


class _Rig:
    """A broker and a node whose archive holds the backlog (written once)."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.broker: Broker | None = None
        self.entries = 0
        self.runs = 0
        self.source_topic: str | None = None

    def setup(self, entries: int) -> None:
        if self.root is not None:
            return
        if not LIBS.is_dir():
            raise RuntimeError(f"{LIBS} missing: run `make install` first")
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-bench-kafka-"))
        atexit.register(self.teardown)
        self.broker = Broker(self.root / "broker", profile="standard")
        self.broker.start()
        with Node.open(self.node_dir, **NODE_SETTINGS) as node:
            put_all = node.cache("bench").put_all
            for start in range(0, entries, TX_SIZE):
                put_all({k: VALUE_100B for k in range(start, min(start + TX_SIZE, entries))})
            node.force_archive()
        self.entries = entries

    @property
    def node_dir(self) -> Path:
        assert self.root is not None
        return self.root / "node"

    def restore(self) -> None:
        """Every archived segment linked into the CDC dir again, no daemon state."""
        cdc = self.node_dir / "cdc"
        archived = list_segments(self.node_dir / "wal" / "archive")[0]
        present = {p.name for p in cdc.iterdir()}
        for path in archived.values():
            if path.name not in present:
                os.link(path, cdc / path.name)
        shutil.rmtree(self.node_dir / "cdcd-state", ignore_errors=True)

    def teardown(self) -> None:
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.source_topic = None


RIG = _Rig()


def _messages(bootstrap: str, topic: str) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-count"})
    try:
        meta = c.list_topics(topic, timeout=30)
        return sum(
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in meta.topics[topic].partitions
        )
    finally:
        c.close()


def run_replay(entries: int) -> Measurement:
    assert RIG.broker is not None
    RIG.restore()
    RIG.runs += 1
    topic = f"bench-{RIG.runs}"
    sink = KafkaSink.from_options(
        {
            "bootstrap_servers": RIG.broker.bootstrap,
            "topic": topic,
            "offsets_topic": f"bench-offsets-{RIG.runs}",  # each run starts with nothing stored
            "topic_partitions": PARTITIONS,
        },
        "bench",
    )
    config = DaemonConfig(node_dir=str(RIG.node_dir), metrics_address="")
    daemon = Daemon(config, sink, show_progress=False)
    try:
        daemon.start()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        while daemon.events_delivered < entries:
            if not daemon.sync_once():
                raise RuntimeError(f"sync_once() delivered nothing at {daemon.events_delivered:,} of {entries:,}")
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        daemon.close()
    # every message committed (data + one commit marker per partition and transaction)
    in_topic = _messages(RIG.broker.bootstrap, topic)
    if in_topic < entries:
        raise AssertionError(f"{in_topic:,} offsets in {topic}, {entries:,} entries sent")
    return Measurement(
        entries,
        seconds,
        {"process_cpu_us_per_entry": round(cpu / entries * 1e6, 2), "topic_offsets": in_topic},
    )


# --- kafka-to-node ------------------------------------------------------------------------------


def run_to_node(entries: int) -> Measurement:
    """``cdcd kafka-to-node`` (2 threads) applies the replayed topic to a fresh node process."""
    assert RIG.broker is not None and RIG.root is not None
    if RIG.source_topic is None:
        run_replay(entries)
        RIG.source_topic = f"bench-{RIG.runs}"
    RIG.runs += 1
    work = RIG.root / f"k2n-{RIG.runs}"
    try:
        seconds = apply_topic_to_node(work, RIG.broker.bootstrap, RIG.source_topic, f"bench-{RIG.runs}", entries)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Measurement(entries, seconds, {"process_start_included": True})


def benchmarks(quick: bool) -> list[Bench]:
    entries = 100_000 if quick else 1_000_000
    return [
        Bench(
            name="kafka.replay",
            description=(
                f"cdcd run (sync_once) drains a {entries:,}-entry backlog ({TX_SIZE}-entry transactions, "
                f"100-byte values) into a local Kafka broker, exactly once, Debezium envelope"
            ),
            run_once=lambda: run_replay(entries),
            setup=lambda: RIG.setup(entries),
            teardown=RIG.teardown,
            params={"entries": entries, "tx_size": TX_SIZE, "value_bytes": 100, "topic_partitions": PARTITIONS},
            max_repeats=3,
            more=(Metric("cpu_per_entry", "process_cpu_us_per_entry", "us"),),
        ),
        Bench(
            name="kafka.to_node",
            description=(
                f"cdcd kafka-to-node (2 threads) applies a {entries:,}-change topic to a fresh node process "
                "through its replication endpoint (process start included)"
            ),
            run_once=lambda: run_to_node(entries),
            setup=lambda: RIG.setup(entries),
            teardown=RIG.teardown,
            params={"entries": entries, "threads": 2, "topic_partitions": PARTITIONS},
            max_repeats=3,
        ),
    ]
