"""A node holding values too big for a topic, and that topic: what the dead-letter tests send to Kafka."""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from cdcd.node import Node
from tests.support.kafka import Broker
from tests.support.wal import wal_events

TOPIC_LIMIT = 65536


def node_with_big_values(node_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """3,000 small changes and three of about 100 kB (incompressible text); (every event, the big ones)."""
    rng = random.Random(5)
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        cache = node.cache("c")
        for i in range(0, 3000, 50):
            batch: dict[int, Any] = {k: {"k": k} for k in range(i, i + 50)}
            if i % 1000 == 300:
                batch[i + 7] = {"k": i + 7, "pad": "".join(rng.choices(string.ascii_letters, k=100_000))}
            cache.put_all(batch)
        node.force_archive()
    events = wal_events(node_dir)
    big = [e for e in events if "pad" in e["value"]]
    assert len(big) == 3
    return events, big


def create_limited_topic(broker: Broker, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    fut = admin.create_topics([NewTopic(topic, 4, 1, config={"max.message.bytes": str(TOPIC_LIMIT)})])[topic]
    fut.result(30)
