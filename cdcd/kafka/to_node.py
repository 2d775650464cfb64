"""``cdcd kafka-to-node``: apply a cdcd topic to a node (Ignite's ``kafka-to-ignite`` twin).

Reader threads each take a share of the partitions (``partitions = "FROM-TO"``), read them with
``read_committed`` from the offsets their consumer group committed, and send each batch's changes
to the target node's replication endpoint, where its conflict resolver decides. Offsets are
committed only after the target confirmed the whole batch durable, so a crash re-applies at most
the last batches: the target recognises a version it already holds and counts it as a duplicate
(``cdcd_kafka_to_node_events_ignored_total``), never applies it twice.

Changes come from the ``cdcd.entry`` header (the WAL entry, exact bytes and version); tombstones
and messages without it are skipped. A truncate event (a dropped cache, header ``cdcd.drop``) drops
the cache on the target once the changes read before it are applied. Cache partition counts come
from the metadata topic, read with a group of its own (``<group_id>-metadata``) from its start and
again whenever a change of an unknown cache arrives (Ignite's metadata markers, IGNITE-20954).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from cdcd import failpoints, metrics
from cdcd.config import CacheFilter
from cdcd.faults import ExitCode, Fault
from cdcd.kafka.drops import DROP_HEADER
from cdcd.kafka.errors import describe, error_of, missing_topic, unknown_topic
from cdcd.kafka.options import KafkaToNodeOptions, parse_partitions
from cdcd.kafka.topics import is_cache_topic
from cdcd.replication.client import TargetRefused
from cdcd.replication.protocol import Applied, ProtocolError, ReplEntry
from cdcd.retry import Backoff, RetriesExhausted, Retry, RetryInterrupted, retry_until
from cdcd.wal.records import CacheVersion, DataEntry

log = structlog.get_logger("cdcd.kafka.to_node")

_BACKOFF = Backoff(initial_ms=100, max_ms=5000)

_entry_decoder = msgspec.msgpack.Decoder(DataEntry)
_version_decoder = msgspec.msgpack.Decoder(CacheVersion | None)
TOPIC_REFRESH_S = 5.0
"""How often kafka-to-node looks for new per-cache topics (``topic_prefix``)."""


class KafkaToNodeError(Fault, Exception):
    """Fatal: the one line ``cdcd kafka-to-node`` prints before exiting non-zero."""

    exit_code = ExitCode.FAILED


class _TopicError(KafkaException):
    """A consumer's error about one topic (which the KafkaError alone does not name)."""

    def __init__(self, err: KafkaError, topic: str) -> None:
        super().__init__(err)
        self.topic = topic


class _Metadata(msgspec.Struct):
    op: str
    cache_id: int
    name: str = ""
    partitions: int = 0


_meta_decoder = msgspec.json.Decoder(_Metadata)


class MetadataReader:
    """Cache name -> partition count, from the metadata topic (shared by the reader threads)."""

    def __init__(self, opts: KafkaToNodeOptions, base: dict[str, Any], source: str) -> None:
        self._opts = opts
        self._source = source
        self._conf = {
            **base,
            "group.id": f"{opts.group_id}-metadata",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
        self._lock = threading.Lock()
        self.partitions: dict[str, int] = {}
        self.read_to = -1

    def refresh(self) -> None:
        """Read the topic from its start to its current end (nothing with ``metadata = false``);
        KafkaToNodeError when it does not exist (Ignite's kafka-to-ignite: "Unknown topic")."""
        if not self._opts.metadata:
            return
        with self._lock:
            topic = self._opts.metadata_topic_name
            c = Consumer(self._conf)
            try:
                meta = c.list_topics(topic, timeout=self._opts.connect_timeout_ms / 1000)
                t = meta.topics.get(topic)
                if t is None or unknown_topic(t.error):
                    raise KafkaToNodeError(
                        f"{self._source}: key 'metadata_topic': {missing_topic(topic, self._opts.bootstrap_servers)} "
                        "(the sink creates it; --no-metadata runs without it)"
                    )
                if t.error is not None:
                    raise KafkaException(t.error)
                if not t.partitions:
                    return
                highs = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in t.partitions}
                pending = {p for p, h in highs.items() if h > 0}
                c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
                deadline = time.monotonic() + 60
                found: dict[str, int] = {}
                n = 0
                while pending:
                    if time.monotonic() > deadline:
                        raise KafkaToNodeError(f"metadata topic {topic}: not read to its end in 60 s")
                    msg = c.poll(0.5)
                    if msg is None:
                        continue
                    err = msg.error()
                    if err is not None:
                        part, offset = msg.partition() or 0, msg.offset() or 0
                        if err.code() == KafkaError._PARTITION_EOF:
                            if offset >= highs[part]:
                                pending.discard(part)
                            continue
                        raise KafkaException(err)
                    value = msg.value()
                    if value is not None:
                        rec = _meta_decoder.decode(value)
                        n += 1
                        if rec.op == "create" and rec.name:
                            found[rec.name] = rec.partitions
                    part, offset = msg.partition() or 0, msg.offset() or 0
                    if offset + 1 >= highs[part]:
                        pending.discard(part)
                self.partitions = found
                metrics.K2N_MARKERS.inc(n)
            finally:
                c.close()


class _Worker:
    def __init__(self, app: KafkaToNode, index: int, partitions: Sequence[int]) -> None:
        self.app = app
        self.index = index
        self.partitions = list(partitions)
        opts = app.opts
        self.client = app.target.client(
            request_timeout_s=opts.request_timeout_ms / 1000, sender_node=f"kafka:{opts.topic or opts.topic_prefix}"
        )

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # handed to the main thread, which exits with it
            self.app.fail(exc)
        finally:
            self.client.close()

    def _run(self) -> None:
        app = self.app
        opts = app.opts
        consumer = Consumer(
            {
                **app.base,
                "group.id": opts.group_id,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
            }
        )
        assigned: set[tuple[str, int]] = set()
        try:
            self._assign_new(consumer, app.data_topics(), assigned)
            looked_s = time.monotonic()
            while not app.stopping.is_set():
                msgs = consumer.consume(opts.max_batch_events, opts.poll_timeout_ms / 1000)
                if msgs:
                    self._batch(consumer, msgs)
                if opts.topic_prefix and time.monotonic() - looked_s >= TOPIC_REFRESH_S:
                    # a new cache's topic: the sink creates it before its first change
                    meta = consumer.list_topics(timeout=opts.connect_timeout_ms / 1000)
                    self._assign_new(consumer, app.topics_of(meta), assigned)
                    looked_s = time.monotonic()
        finally:
            consumer.close()

    def _assign_new(self, consumer: Consumer, topics: dict[str, int], assigned: set[tuple[str, int]]) -> None:
        """Read this thread's partitions of ``topics`` not read yet, from the group's offsets."""
        tps = [
            TopicPartition(t, p)
            for t, count in sorted(topics.items())
            for p in self.partitions
            if p < count and (t, p) not in assigned
        ]
        if not tps:
            return
        committed = consumer.committed(tps, timeout=self.app.opts.connect_timeout_ms / 1000)
        start = [
            TopicPartition(c.topic, c.partition, c.offset if c.offset >= 0 else OFFSET_BEGINNING) for c in committed
        ]
        consumer.incremental_assign(start)
        assigned.update((c.topic, c.partition) for c in committed)
        log.info(
            "kafka_to_node_reading",
            thread=self.index,
            partitions=self.partitions,
            offsets={f"{c.topic}:{c.partition}": c.offset for c in committed},
        )

    def _batch(self, consumer: Consumer, msgs: list[Message]) -> None:
        app = self.app
        next_offsets: dict[tuple[str, int], int] = {}
        entries: list[tuple[str, DataEntry]] = []
        skipped = {"tombstone": 0, "filtered": 0, "replicated": 0, "truncate": 0}
        read = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise _TopicError(err, m.topic() or "")
            read += 1
            next_offsets[(m.topic() or "", m.partition() or 0)] = (m.offset() or 0) + 1
            headers: dict[str, Any] = dict(m.headers() or ())
            if DROP_HEADER in headers:  # a truncate event: what came before it first, then the drop
                cache = bytes(headers.get("cdcd.cache") or b"").decode()
                skipped["truncate" if app.selected(cache) else "filtered"] += 1
                if app.selected(cache):
                    self._flush(entries)
                    entries = []
                    self._drop(cache, _version_decoder.decode(headers[DROP_HEADER] or b"\xc0"))
                continue
            raw = headers.get("cdcd.entry")
            if m.value() is None or not isinstance(raw, bytes):
                skipped["tombstone"] += 1
                continue
            cache = bytes(headers.get("cdcd.cache") or b"").decode()
            e = _entry_decoder.decode(raw)
            if e.version.other_cluster_version is not None:
                skipped["replicated"] += 1  # came from another cluster: applying it would loop back
                continue
            if not app.selected(cache):
                skipped["filtered"] += 1
                continue
            entries.append((cache, e))
        if not next_offsets:
            return  # partition ends only: nothing read, nothing to commit
        # Every message read ends in exactly one of applied, ignored, rejected or skipped (partition-end
        # events are no messages).
        metrics.K2N_RECEIVED.inc(read)
        for reason, n in skipped.items():
            if n:
                metrics.K2N_SKIPPED.labels(reason).inc(n)
        if skipped["replicated"]:  # what a replication sender reports (this process exports its families)
            metrics.REPL_SKIPPED_EVENTS.labels("replicated").inc(skipped["replicated"])
        failpoints.hit("kafka_to_node.received")  # read, neither applied nor committed
        self._flush(entries)
        failpoints.hit("kafka_to_node.applied")  # on the target, offsets not committed: a replay follows
        # only now: everything before these offsets is durable on the target
        consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in next_offsets.items()], asynchronous=False)
        now = time.time()
        metrics.K2N_LAST_BATCH.set(now)
        metrics.REPL_LAST_BATCH.set(now)

    def _flush(self, entries: list[tuple[str, DataEntry]]) -> None:
        app = self.app
        if entries:
            if app.opts.metadata and any(cache not in app.metadata.partitions for cache, _e in entries):
                app.metadata.refresh()
            self._apply(entries)

    def _drop(self, cache: str, version: CacheVersion | None) -> None:
        """The target drops ``cache`` (once per drop: the truncate event of every other partition,
        or of a replay, is a duplicate there)."""

        def attempt() -> Applied:
            if not self.client.connected:
                self.client.sender_cluster_id = version.cluster_id if version is not None else 0
                self.client.connect()
            return self.client.drop(cache, version)

        result = self._retried(attempt)
        log.info("kafka_to_node_cache_dropped", thread=self.index, cache=cache, duplicate=bool(result.duplicates))

    def _requests(self, entries: list[tuple[str, DataEntry]]) -> Iterator[tuple[str, list[ReplEntry]]]:
        """Per-cache requests in topic order; a key that comes again closes its cache's request
        (one request never holds two changes of a key)."""
        pending: dict[str, tuple[list[ReplEntry], set[bytes]]] = {}
        for cache, e in entries:
            slot = pending.get(cache)
            key = bytes(e.key)
            if slot is not None and key in slot[1]:
                yield cache, slot[0]
                slot = None
            if slot is None:
                slot = pending[cache] = ([], set())
            slot[0].append(ReplEntry(e.op, e.key, e.value, e.version, e.expire_time_ms))
            slot[1].add(key)
        for cache, (out, _keys) in pending.items():
            if out:
                yield cache, out

    def _retrying(self, retry: Retry) -> None:
        metrics.K2N_RETRIES.inc()
        metrics.REPL_RETRIES.inc()
        log.warning("kafka_to_node_retry", thread=self.index, error=f"{type(retry.error).__name__}: {retry.error}")

    def _apply(self, entries: list[tuple[str, DataEntry]]) -> None:
        app = self.app

        def attempt() -> Applied:
            if not self.client.connected:
                self.client.sender_cluster_id = entries[0][1].version.cluster_id
                welcome = self.client.connect()
                log.info(
                    "kafka_to_node_connected",
                    thread=self.index,
                    target=self.client.target,
                    target_cluster=welcome.cluster_id,
                )
            return self.client.apply_all(self._requests(entries), partitions=app.metadata.partitions)

        result = self._retried(attempt)
        metrics.K2N_APPLIED.inc(result.applied)
        metrics.K2N_IGNORED.inc(result.duplicates)
        metrics.K2N_REJECTED.inc(result.rejected)
        metrics.REPL_SENT_EVENTS.inc(result.applied + result.rejected + result.duplicates)
        metrics.REPL_CONFLICTS.inc(result.rejected)

    def _retried(self, attempt: Callable[[], Applied]) -> Applied:
        opts = self.app.opts
        try:
            return retry_until(
                attempt,
                opts.retry_timeout_s,
                _BACKOFF,
                retriable=(OSError, ProtocolError),
                stop=self.app.stopping,
                on_retry=self._retrying,
            )
        except TargetRefused as exc:
            raise KafkaToNodeError(f"key 'target': {exc}") from None
        except (RetriesExhausted, RetryInterrupted) as exc:
            raise KafkaToNodeError(
                f"key 'target': replication target {self.client.target} failing for {exc.failing_for_s:.1f} s "
                f"(retry_timeout_s = {opts.retry_timeout_s:g}): {type(exc.last).__name__}: {exc.last}"
            ) from None


class KafkaToNode:
    def __init__(self, opts: KafkaToNodeOptions, source: str) -> None:
        self.opts = opts
        self.source = source
        self.base = opts.librdkafka(source)
        self.target = opts.replication.open(source)
        self._filter = CacheFilter(opts.caches, opts.exclude_caches)
        self._selected: dict[str, bool] = {}
        self.metadata = MetadataReader(opts, self.base, source)
        self.stopping = threading.Event()
        self._failure: BaseException | None = None
        self._failed = threading.Event()

    def selected(self, cache: str) -> bool:
        ok = self._selected.get(cache)
        if ok is None:
            ok = self._selected[cache] = bool(self._filter(cache))
        return ok

    def fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._failed.set()
        self.stopping.set()

    def stop(self) -> None:
        """Stop after the batches in hand (callable from a signal handler)."""
        self.stopping.set()

    def topics_of(self, meta: Any) -> dict[str, int]:
        """The data topics in cluster metadata, with their partition counts: ``topic``, or every
        ``<topic_prefix>.<suffix>`` but the dead-letter topics (the transaction topic's records carry no change:
        skipped)."""
        opts = self.opts
        if opts.topic:
            t = meta.topics.get(opts.topic)
            if t is None or unknown_topic(t.error):
                raise KafkaToNodeError(
                    f"{self.source}: key 'topic': {missing_topic(opts.topic, opts.bootstrap_servers)}"
                )
            if t.error is not None:
                raise KafkaToNodeError(f"{self.source}: key 'topic': {opts.topic}: {t.error.str()}")
            return {opts.topic: len(t.partitions)}
        # Not the dead-letter topics: their changes were set aside for an operator, as with ``topic``.
        return {
            name: len(t.partitions)
            for name, t in meta.topics.items()
            if is_cache_topic(opts.topic_prefix, name)
            and name != opts.metadata_topic_name
            and t.error is None
            and t.partitions
        }

    def data_topics(self) -> dict[str, int]:
        opts = self.opts
        timeout_s = opts.connect_timeout_ms / 1000
        probe = Consumer({**self.base, "group.id": opts.group_id})
        try:
            try:
                meta = probe.list_topics(opts.topic or None, timeout=timeout_s)
            except KafkaException as exc:
                servers = opts.bootstrap_servers
                raise KafkaToNodeError(
                    f"{self.source}: key 'bootstrap_servers': cannot reach {servers} "
                    f"in {timeout_s:g} s: {describe(exc)}"
                ) from None
        finally:
            probe.close()
        return self.topics_of(meta)

    def partition_plan(self) -> list[list[int]]:
        """The partitions each thread reads (contiguous shares of the range, as kafka-to-ignite);
        with ``topic_prefix`` partition numbers of every per-cache topic."""
        opts = self.opts
        topics = self.data_topics()
        if not topics:
            raise KafkaToNodeError(
                f"{self.source}: key 'topic_prefix': no topic {opts.topic_prefix}.* yet (the sink makes one per cache)"
            )
        count = max(topics.values())
        lo, hi = (
            parse_partitions(opts.partitions, f"{self.source}: key 'partitions'") if opts.partitions else (0, count - 1)
        )
        if hi >= count:
            name = opts.topic or f"{opts.topic_prefix}.*"
            raise KafkaToNodeError(f"{self.source}: key 'partitions': {lo}-{hi}, but topic {name} has {count}")
        parts = list(range(lo, hi + 1))
        n = min(opts.threads, len(parts))
        return [parts[i * len(parts) // n : (i + 1) * len(parts) // n] for i in range(n)]

    def run(self) -> None:
        """Read and apply until ``stop()``; raises the first thread's failure."""
        plan = self.partition_plan()
        self.metadata.refresh()
        workers = [_Worker(self, i, parts) for i, parts in enumerate(plan)]
        threads = [threading.Thread(target=w.run, name=f"kafka-to-node-{w.index}", daemon=True) for w in workers]
        for t in threads:
            t.start()
        log.info("kafka_to_node_started", threads=len(threads), plan=plan, options=self.opts.describe())
        for t in threads:
            t.join()
        if self._failure is not None:
            exc = self._failure
            if isinstance(exc, KafkaToNodeError):
                raise exc
            if isinstance(exc, KafkaException):
                err = error_of(exc)
                if err is not None and unknown_topic(err) and isinstance(exc, _TopicError):
                    where = missing_topic(exc.topic, self.opts.bootstrap_servers)
                    raise KafkaToNodeError(f"{self.source}: key 'topic': {where}") from exc
                raise KafkaToNodeError(f"{self.source}: key 'bootstrap_servers': {describe(exc)}") from exc
            raise KafkaToNodeError(f"{type(exc).__name__}: {exc}") from exc
