"""``kind = "kafka"``: every change into Kafka exactly once, in Debezium's envelope, into one
topic or one per cache (Ignite's ``IgniteToKafkaCdcStreamer`` twin).

Exactly once: a transactional producer (``transactional.id`` per source node) sends a batch's
messages and the WAL position of its last entry (to the compacted offsets topic, see
``offsets``) in one Kafka transaction. When a producer starts it fences any older one of the same
id, then reads that position back; entries at or below it are skipped, so whatever the daemon
re-delivers after a crash (its own position is committed after ours) is not sent twice. Any error
inside a transaction drops the producer: the next attempt starts a new one, which aborts what
the old one left open and re-reads the position. A producer fenced by another (the realtime
worker and the daemon hand over) does the same: it re-takes the id and the position.

A change goes to Kafka partition ``cache partition % topic_partitions`` (Ignite's rule), keyed
``{"cache", "key"}`` (one topic) or by the row's key columns (``topic_prefix``: topic
``<prefix>.<cache>``, names as ``topics`` maps them, created when the cache is first seen); a
delete is followed by a tombstone.
With ``transaction_metadata`` each node transaction's BEGIN/END records go to the transaction
topic in the same Kafka transactions as its events (``transactions``). Headers ``cdcd.entry`` (the WAL entry,
MessagePack) and ``cdcd.cache`` let ``cdcd kafka-to-node`` apply the exact bytes. Cache
created/destroyed records go to the metadata topic before the changes of the cache.

A change whose message is larger than its topic takes (``max.message.bytes``, at most
``max_message_bytes``; measured before compression) is refused: with ``dead_letters = "on"`` it goes
to ``<topic>.dlq`` instead, in the same transaction (so exactly once, as the rest); otherwise the
daemon fails with one line naming its position.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import structlog
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

from cdcd import failpoints, metrics
from cdcd.config import ConfigError
from cdcd.consumer import CacheDrop, CacheInfo, CdcEvent, Consumer, EventBatch, RefusedEvent, RetriableError
from cdcd.kafka import drops as drops_mod
from cdcd.kafka import envelope, offsets, topics, transactions
from cdcd.kafka.dlq import dlq_record
from cdcd.kafka.errors import KafkaSetupError, describe, error_of, missing_topic, setting_of, unknown_topic
from cdcd.kafka.metadata import MetadataRecord, MetadataTopic
from cdcd.kafka.options import KafkaSinkOptions
from cdcd.wal.records import Op

log = structlog.get_logger("cdcd.kafka.sink")


_entry_encoder = msgspec.msgpack.Encoder()
OFFSETS_TOPIC_PARTITIONS = 1
Headers = list[tuple[str, str | bytes | None]]
RECORD_OVERHEAD_BYTES = 128
"""A record's bytes besides key, value and headers, and its batch's header (an upper bound)."""


class KafkaSink(Consumer):
    def __init__(self, options: KafkaSinkOptions, source: str) -> None:
        self.options = options
        self.source = source
        self._base = options.librdkafka(source)
        self._producer: Producer | None = None
        self._node = ""
        self._stored: offsets.Stored | None = None
        """The source's position in Kafka (generation, what is sent of an open node transaction)."""
        self._admin: AdminClient | None = None
        self._topics: dict[str, str] = {}
        """Cache name -> its topic (``topic_prefix``), once the topic exists."""
        self._offsets_partitions = OFFSETS_TOPIC_PARTITIONS
        self._delivery_error: KafkaError | None = None
        self._tx_open = False
        """A Kafka transaction is begun and not committed (aborted if the producer is dropped)."""
        self._alive = True
        self._interrupted = threading.Event()
        self._metadata = MetadataTopic(self._base, options, source)
        self._limits: dict[str, int] = {}
        """Topic -> the largest message it takes."""
        self._dlqs: set[str] = set()
        """Dead-letter topics known to exist."""
        self.sent = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> KafkaSink:
        return cls(KafkaSinkOptions.load(options, source), source)

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, registry: Any = None) -> None:
        metrics.export(metrics.KAFKA_SINK)
        opts = self.options
        try:
            admin = AdminClient({**self._base, "socket.connection.setup.timeout.ms": opts.connect_timeout_ms})
        except KafkaException as exc:
            raise KafkaSetupError(f"{self.source}: key 'client_config': {describe(exc)}") from None
        self._admin = admin
        compact = {"cleanup.policy": "compact"}
        wanted = {
            opts.metadata_topic_name: (1, compact),
            opts.offsets_topic: (OFFSETS_TOPIC_PARTITIONS, compact),
        }
        if opts.topic:
            wanted[opts.topic] = (opts.topic_partitions, {})
        if opts.transaction_metadata:
            wanted[opts.transaction_topic_name] = (1, {})
        topics.ensure_topics(admin, wanted, opts, self.source)
        meta = topics.settled(admin, [opts.offsets_topic], opts, self.source)
        self._offsets_partitions = len(meta.topics[opts.offsets_topic].partitions)
        log.info("kafka_sink_started", options=opts.describe())

    def stop(self) -> None:
        p, self._producer = self._producer, None
        if p is not None:
            # nothing of ours should be open; if something is (or the cluster is away), the next
            # producer's init aborts it: never wait long here
            if self._tx_open:
                self._tx_open = False
                metrics.KAFKA_TRANSACTION_ABORTS.inc()
            with contextlib.suppress(KafkaException):
                p.abort_transaction(1.0)
        self._metadata.close()

    def alive(self) -> bool:
        return self._alive

    def interrupt(self) -> None:
        self._interrupted.set()

    # --- metadata -----------------------------------------------------------------------------------

    def _send_metadata(self, records: Sequence[MetadataRecord]) -> None:
        try:
            self._metadata.send(records)
        except ConnectionError:
            self._alive = False
            raise

    def _topic_of(self, cache: str) -> str:
        """The data topic of a cache; with ``topic_prefix`` created when first asked for."""
        topic = self.options.topic or self._topics.get(cache)
        if topic:
            return topic
        opts = self.options
        try:
            topic, avoided = topics.cache_topic(opts, cache)
        except topics.TopicNameError as exc:
            self._alive = False
            raise KafkaSetupError(f"{self.source}: {exc}") from None
        if avoided:
            log.warning(
                "kafka_topic_escaped",
                cache=cache,
                topic=topic,
                reason=f"{opts.topic_prefix}.{topics.suffix_of(cache)} would fold like the {avoided}",
            )
        assert self._admin is not None, "start() first"
        topics.ensure_topics(self._admin, {topic: (opts.topic_partitions, {})}, opts, self.source)
        self._topics[cache] = topic
        return topic

    def on_cache_change(self, caches: Sequence[CacheInfo]) -> None:
        if self.options.topic_prefix:
            for c in caches:
                self._topic_of(c.name)
        recs = [
            MetadataRecord(
                "create", c.cache_id, c.name, c.config.partitions, c.config.cdc_enabled, c.config.ttl_ms, self._node
            )
            for c in caches
        ]
        if recs:
            self._send_metadata(recs)

    def on_cache_destroy(self, cache_ids: Sequence[int]) -> None:
        if cache_ids:
            self._send_metadata([MetadataRecord("destroy", cid, node=self._node) for cid in cache_ids])

    def on_cache_drop(self, drops: Sequence[CacheDrop]) -> None:
        """The metadata record, then a truncate event (``op = "t"``) on every partition of the cache's
        topic in a transaction of its own that also moves the stored position to the DESTROY record:
        sent once, as a batch is (cdcd/kafka/drops.py)."""
        if not drops:
            return
        self._send_metadata([MetadataRecord("destroy", d.cache_id, d.name, node=d.source_node) for d in drops])
        for drop in drops:
            try:
                if self._producer is None or self._node != drop.source_node:
                    self._open(drop.source_node)
                assert self._producer is not None
                self._tx_open = True  # from its begin_transaction on; a failure before it counts one abort too many
                self._stored = drops_mod.send_truncate(
                    self._producer,
                    self.options,
                    self._stored,
                    drop,
                    topic_of=self._topic_of,
                    offsets_partitions=self._offsets_partitions,
                )
                self._tx_open = False
            except (KafkaException, TimeoutError, BufferError) as exc:
                self._drop_producer()
                # The delivery loop offers the drop again (the stored position skips a truncate that landed).
                raise RetriableError(
                    f"{self.source}: Kafka at {self.options.bootstrap_servers}: truncate of cache {drop.name!r}: "
                    f"{describe(exc)}"
                ) from None

    # --- data -------------------------------------------------------------------------------------

    def _open(self, node: str) -> None:
        """A new producer for ``node``: fences older ones, then reads back the stored position."""
        opts = self.options
        self._drop_producer()
        conf = {
            **self._base,
            "transactional.id": opts.transactional_id or f"cdcd-{node}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": opts.linger_ms,
            "batch.size": opts.batch_size_bytes,
            "message.max.bytes": opts.max_message_bytes,
            "compression.type": opts.compression,
            "transaction.timeout.ms": opts.transaction_timeout_ms,
            "request.timeout.ms": opts.request_timeout_ms,
            "queue.buffering.max.messages": min(2 * opts.max_events_per_transaction + 1000, 2_000_000),
        }
        p = Producer(conf)
        p.init_transactions(opts.transaction_timeout_ms / 1000)
        self._stored = stored = offsets.read_stored(
            self._base, opts.offsets_topic, self._offsets_partitions, node, opts.transaction_timeout_ms / 1000
        )
        self._producer = p
        self._node = node
        log.info(
            "kafka_producer_ready",
            node=node,
            position=stored and stored.address,
            generation=stored and stored.generation,
        )

    def _drop_producer(self) -> None:
        p, self._producer = self._producer, None
        if self._tx_open:  # begun and never committed: aborted by the next producer's init (or times out)
            self._tx_open = False
            metrics.KAFKA_TRANSACTION_ABORTS.inc()
        if p is not None:
            # purge what is queued, not flush: the next producer's init aborts the open transaction
            with contextlib.suppress(KafkaException):  # a fatal producer refuses even that
                p.purge()
        self._stored = None

    def _on_delivery(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None and self._delivery_error is None:
            self._delivery_error = err

    def _missing_topics(self) -> list[str]:
        """The data topics this sink wrote to that the cluster no longer has ([]: it cannot tell)."""
        names = [self.options.topic] if self.options.topic else sorted(set(self._topics.values()))
        assert self._admin is not None, "start() first"
        try:
            meta = self._admin.list_topics(timeout=self.options.connect_timeout_ms / 1000)
        except KafkaException:
            return []
        return [t for t in names if t not in meta.topics]

    def on_events(self, batch: EventBatch) -> bool:
        if not len(batch):
            return True
        if self._interrupted.is_set():
            return False
        opts = self.options
        try:
            if self._producer is None or self._node != batch.source_node:
                self._open(batch.source_node)
            self._send(batch)
        except RefusedEvent:
            self._drop_producer()  # its open transaction is aborted by the next producer's init
            raise
        except (KafkaException, TimeoutError, BufferError) as exc:
            err = error_of(exc) or self._delivery_error
            setting = setting_of(err) if err is not None else None
            self._drop_producer()
            if setting is not None and err is not None:
                self._alive = False
                raise KafkaSetupError(
                    f"{self.source}: key '{setting}': {err.name()}: {err.str()} (nothing of this batch committed)"
                ) from None
            gone = self._missing_topics() if unknown_topic(err) else []
            if gone:  # deleted while running: no retry brings it back
                self._alive = False
                where = missing_topic(gone[0], opts.bootstrap_servers)
                key = topics.setting_of(gone[0], opts)
                raise KafkaSetupError(
                    f"{self.source}: key '{key}': {where} (nothing of this batch committed)"
                ) from None
            # The delivery loop offers the batch again (a new producer then aborts what this one
            # left open and re-reads the stored position), up to retry_timeout_s.
            metrics.KAFKA_RETRIES.inc()
            raise RetriableError(f"{self.source}: Kafka at {opts.bootstrap_servers}: {describe(exc)}") from None
        return True

    def _send(self, batch: EventBatch) -> offsets.Address | None:
        """One transaction: the batch's entries above the stored position (at most
        ``max_events_per_transaction``) and the position of the last. Returns that position."""
        p = self._producer
        assert p is not None
        opts = self.options
        nparts = opts.topic_partitions
        schemas = opts.schemas
        tombstones = opts.tombstones
        only_primary = opts.only_primary
        per_cache = bool(opts.topic_prefix)
        tx_topic = opts.transaction_topic_name if opts.transaction_metadata else ""
        name = opts.source_name
        node = batch.source_node
        db = opts.db or node
        stored = self._stored
        committed = None if stored is None else stored.address
        generation = 0 if stored is None else stored.generation
        self._delivery_error = None
        skipped = {"already_sent": 0, "backup": 0}
        sent_per_cache: dict[str, int] = {}
        dead: list[tuple[CdcEvent, str]] = []
        now_ns = time.time_ns()
        # a record's last entry in the batch (its last slice's end): its node transaction ends there
        record_ends = {(s.pointer.segment, s.pointer.offset): s.end - 1 for s in batch.peek_slices()}
        tracker = transactions.Tracker.resume(stored)
        last: offsets.Address | None = None
        last_ts_ns = 0
        n = 0
        begun = False

        def end_transaction(ts_ms: int) -> None:
            rec = tracker.record
            done = tracker.end()
            if tx_topic and done is not None and rec is not None:
                tx_id = envelope.transaction_id(node, generation, *rec)
                value = transactions.record_bytes("END", tx_id, ts_ms, done, schemas)
                self._produce(p, tx_topic, transactions.key_bytes(tx_id, schemas), value, part=0, headers=None)

        for ev in batch:
            pos = ev.position
            here = (pos.segment, pos.offset, pos.entry_index)  # the event's own place, as a plain tuple
            if committed is not None and here <= committed:
                assert stored is not None
                if not offsets.diverged(stored, here, ev.commit_ts_ns):
                    skipped["already_sent"] += 1
                    continue
                generation, committed = generation + 1, None  # from here on: all of it, as a new generation
                tracker = transactions.Tracker(None, None)  # the old one's open node transaction never ends
                log.warning("kafka_source_diverged", source=node, at=here, stored=stored.address, generation=generation)
            last, last_ts_ns = here, ev.commit_ts_ns
            record = (pos.segment, pos.offset)
            ts_ms = ev.commit_ts_ns // 1_000_000
            if not begun:
                p.begin_transaction()
                self._tx_open = begun = True
            if tracker.record is not None and tracker.record != record:
                end_transaction(ts_ms)  # its last entries were not in a batch (a cdc-disabled cache's)
            e = ev.entry
            cache = ev.cache_name
            if only_primary and not e.primary:
                skipped["backup"] += 1
            else:
                topic = self._topic_of(cache)
                begin, total_order, order = tracker.event(record, f"{db}.{cache}")
                if begin and tx_topic:
                    tx_id = envelope.transaction_id(node, generation, *record)
                    value = transactions.record_bytes("BEGIN", tx_id, ts_ms, None, schemas)
                    self._produce(p, tx_topic, transactions.key_bytes(tx_id, schemas), value, part=0, headers=None)
                source = envelope.Source(name, db, node, generation, cache, pos, ev.commit_ts_ns, ev.resend)
                key, value = envelope.change(
                    e, source, now_ns, total_order, order, per_cache=per_cache, schemas=schemas
                )
                part = e.partition % nparts
                entry = _entry_encoder.encode(e)
                headers: list[tuple[str, str | bytes | None]] = [("cdcd.cache", cache.encode()), ("cdcd.entry", entry)]
                size = len(key) + len(value) + len(entry) + len(cache) + RECORD_OVERHEAD_BYTES
                if size > (self._limits.get(topic) or self._limit_of(topic)):
                    dead.append((ev, self._dead_letter(p, topic, ev, key=key, value=value, headers=headers, size=size)))
                else:
                    self._produce(p, topic, key, value, part=part, headers=headers)
                    if tombstones and e.op == Op.DELETE:
                        self._produce(p, topic, key, None, part=part, headers=None)
                    sent_per_cache[cache] = sent_per_cache.get(cache, 0) + 1
                    n += 1
            if pos.entry_index == record_ends.get(record):
                end_transaction(ts_ms)
            if n >= opts.max_events_per_transaction:
                break
        for reason, count in skipped.items():
            if count:
                metrics.KAFKA_SKIPPED_EVENTS.labels(reason).inc(count)
        if last is None:
            return None  # everything was in Kafka already
        new_stored = offsets.stored(node, last, tracker.state(), generation, last_ts_ns)
        p.produce(
            opts.offsets_topic,
            key=node.encode(),
            value=offsets.encode_stored(new_stored),
            partition=offsets.partition_of(node, self._offsets_partitions),
            on_delivery=self._on_delivery,
        )
        t0 = time.perf_counter()
        p.commit_transaction(opts.transaction_timeout_ms / 1000)
        self._tx_open = False
        failpoints.hit("kafka.committed")  # in Kafka, not yet in the caller's state: a re-delivery follows
        metrics.KAFKA_COMMIT_SECONDS.observe(time.perf_counter() - t0)
        self._stored = new_stored
        metrics.KAFKA_TRANSACTIONS.inc()
        metrics.KAFKA_LAST_COMMIT.set(time.time())
        for cache, count in sent_per_cache.items():
            metrics.KAFKA_SENT_EVENTS.labels(cache).inc(count)
            self.sent += count
        for ev, error in dead:
            metrics.DAEMON_DEAD_LETTERS.labels(ev.cache_name).inc()
            log.warning("dead_letter", position=str(ev.position.cursor()), cache=ev.cache_name, error=error)
        return last

    def _limit_of(self, topic: str) -> int:
        assert self._admin is not None, "start() first"
        limit = self._limits[topic] = topics.max_message_bytes(self._admin, topic, self.options)
        return limit

    def _dead_letter(
        self, p: Producer, topic: str, ev: CdcEvent, *, key: bytes, value: bytes, headers: Headers, size: int
    ) -> str:
        """Send the change that ``topic`` refuses to ``<topic>.dlq`` in the open transaction (or raise
        ``RefusedEvent`` with dead letters off); returns why it was refused."""
        error = (
            f"a message of {size} bytes is over the {self._limits[topic]} bytes topic {topic} takes "
            "(its max.message.bytes, at most max_message_bytes)"
        )
        if not self.dead_letters:
            raise RefusedEvent(ev.position, error)
        dlq = topics.dlq_topic(topic)
        limit = self.options.max_message_bytes
        if dlq not in self._dlqs:
            assert self._admin is not None, "start() first"
            topics.ensure_topics(self._admin, {dlq: (1, {"max.message.bytes": str(limit)})}, self.options, self.source)
            self._dlqs.add(dlq)
        data = dlq_record(ev, topic, error, key=key, value=value, max_bytes=limit - len(key) - RECORD_OVERHEAD_BYTES)
        if len(data) + len(key) + len(headers[1][1] or b"") + RECORD_OVERHEAD_BYTES > limit:
            headers = headers[:1]  # the entry too: it holds the value again
        self._produce(p, dlq, key, data, part=0, headers=headers)
        return error

    def _produce(
        self, p: Producer, topic: str, key: bytes, value: bytes | None, *, part: int, headers: Headers | None
    ) -> None:
        while True:
            try:
                p.produce(topic, key=key, value=value, partition=part, headers=headers, on_delivery=self._on_delivery)
                return
            except BufferError:
                p.poll(0.05)  # the local queue is full: let deliveries drain it
            if self._delivery_error is not None:
                raise KafkaException(self._delivery_error)


def load(options: Mapping[str, Any], source: str) -> KafkaSink:
    try:
        return KafkaSink.from_options(options, source)
    except KafkaException as exc:  # librdkafka refused a property
        raise ConfigError(f"{source}: key 'client_config': {describe(exc)}") from None
