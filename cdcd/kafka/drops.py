"""A dropped cache in Kafka: Debezium's truncate event, exactly once.

The sink sends one truncate event (``op = "t"``, key null, ``before``/``after`` null) to every
partition of the cache's topic, so a reader of any partition meets it between the cache's last
change before the drop and its first change after, plus the WAL position of the DESTROY record to
the offsets topic, in one Kafka transaction of its own. The daemon hands the drop to the sink only
after the batch before it is committed and commits its own position past the drop only after the
sink returns, so a crash in between sends the drop again: at or below the stored position it is
skipped, as a re-delivered entry is. Headers ``cdcd.cache`` and ``cdcd.drop`` (the drop's version,
MessagePack) tell ``cdcd kafka-to-node`` to drop the cache on its target.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog
from confluent_kafka import KafkaError, KafkaException, Producer

from cdcd import failpoints, metrics
from cdcd.consumer import CacheDrop
from cdcd.kafka import envelope, offsets, transactions
from cdcd.kafka.options import KafkaSinkOptions
from cdcd.wal.pointer import EventAddress

log = structlog.get_logger("cdcd.kafka.sink")

DROP_HEADER = "cdcd.drop"
"""Header of a truncate event: the drop's version as MessagePack (``nil``: not known)."""

_encode = msgspec.msgpack.Encoder().encode


def send_truncate(
    p: Producer,
    opts: KafkaSinkOptions,
    stored: offsets.Stored | None,
    drop: CacheDrop,
    *,
    topic_of: Callable[[str], str],
    offsets_partitions: int,
) -> offsets.Stored | None:
    """Send ``drop`` (unless the stored position is at or past it); returns the stored position after."""
    here = (drop.position.segment, drop.position.offset, 0)
    if stored is not None and here <= stored.address and not offsets.diverged(stored, here, drop.ts_ns):
        metrics.KAFKA_SKIPPED_EVENTS.labels("already_sent").inc()
        log.info("kafka_truncate_already_sent", cache=drop.name, at=str(drop.position))
        return stored
    node = drop.source_node
    generation = 0 if stored is None else stored.generation
    src = envelope.Source(
        opts.source_name, opts.db or node, node, generation, drop.name, EventAddress(*here), drop.ts_ns, False
    )
    errors: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            errors.append(err)

    topic = topic_of(drop.name)
    now_ns = time.time_ns()
    headers: list[tuple[str, str | bytes | None]] = [
        ("cdcd.cache", drop.name.encode()),
        (DROP_HEADER, _encode(drop.version)),
    ]
    p.begin_transaction()
    for part in range(opts.topic_partitions):
        value = envelope.truncate(src, drop.version, part, now_ns, schemas=opts.schemas)
        p.produce(topic, key=None, value=value, partition=part, headers=headers, on_delivery=delivered)
    open_tx = transactions.Tracker.resume(stored).state()
    new_stored = offsets.stored(node, here, open_tx, generation, drop.ts_ns)
    p.produce(
        opts.offsets_topic,
        key=node.encode(),
        value=offsets.encode_stored(new_stored),
        partition=offsets.partition_of(node, offsets_partitions),
        on_delivery=delivered,
    )
    p.commit_transaction(opts.transaction_timeout_ms / 1000)
    failpoints.hit("kafka.truncate_committed")  # in Kafka, the daemon not told: it sends the drop again
    if errors:
        raise KafkaException(errors[0])
    metrics.KAFKA_TRANSACTIONS.inc()
    log.info("kafka_truncate_sent", cache=drop.name, topic=topic, at=str(drop.position))
    return new_stored
