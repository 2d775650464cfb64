"""The metadata topic: a record per cache created or destroyed, keyed by cache name, sent before the
changes of that cache (Ignite's ``IgniteToKafkaCdcStreamer`` writes its metadata topic likewise)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from confluent_kafka import KafkaError, Producer

from cdcd import metrics
from cdcd.consumer import RetriableError
from cdcd.kafka.options import KafkaSinkOptions

__all__ = ["MetadataRecord", "MetadataTopic"]


class MetadataRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """A value of the metadata topic (keyed by cache name)."""

    op: str
    """create or destroy"""
    cache_id: int
    name: str = ""
    partitions: int = 0
    cdc_enabled: bool = True
    ttl_ms: int = 0
    node: str = ""


class MetadataTopic:
    """Its own idempotent producer, not transactional: a record sent twice says the same thing again."""

    def __init__(self, base_conf: Mapping[str, Any], options: KafkaSinkOptions, source: str) -> None:
        self._base = base_conf
        self._options = options
        self._source = source
        self._producer: Producer | None = None

    def send(self, records: Sequence[MetadataRecord]) -> None:
        """In the topic when this returns. RetriableError while the broker is away (the delivery loop
        waits it out); ConnectionError when the topic refuses the records."""
        if self._producer is None:
            self._producer = Producer({**self._base, "enable.idempotence": True, "acks": "all"})
        p = self._producer
        opts = self._options
        errors: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                errors.append(err)

        for rec in records:
            p.produce(
                opts.metadata_topic_name,
                key=(rec.name or str(rec.cache_id)).encode(),
                value=msgspec.json.encode(rec),
                partition=0,
                on_delivery=delivered,
            )
        # Bounded as a transaction is: a broker away for longer is waited out by the delivery loop's
        # retries (a re-send of a queued record is harmless: the topic keeps the last per key).
        left = p.flush(opts.transaction_timeout_ms / 1000)
        if left and not errors:
            raise RetriableError(
                f"{self._source}: Kafka at {opts.bootstrap_servers}: {left} metadata records not confirmed "
                f"within transaction_timeout_ms = {opts.transaction_timeout_ms}"
            )
        if errors:
            reason = f"{errors[0].name()}: {errors[0].str()}"
            raise ConnectionError(
                f"{self._source}: key 'metadata_topic': cannot write to {opts.metadata_topic_name}: {reason}"
            )
        metrics.KAFKA_METADATA_RECORDS.inc(len(records))

    def close(self) -> None:
        p, self._producer = self._producer, None
        if p is not None:
            p.flush(5.0)
