"""Each source node's delivered position in Kafka, written in the same transaction as the data.

The offsets topic is compacted, keyed by source node (Kafka Connect's exactly-once source
connectors keep their offsets the same way). The value is JSON ``{"segment", "offset",
"entry_index", "node", ..., "format"}`` (``format``: ``cdcd.formats.KAFKA_OFFSETS``, absent in v0.1.0's
records): the WAL address of the last entry the committed transactions hold
(inclusive). A reader sees only committed records (``read_committed``), so the position it finds
and the data in the topic always agree.

When that entry is inside a node transaction (a WAL record) whose last events are still to come
(a batch cut at ``max_events_per_transaction``), the record also holds what was sent of it:
``tx_events`` and ``tx_collections`` (events per data collection). The events after it continue
their ``total_order``/``data_collection_order`` from there, and its END record counts them all.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from cdcd import formats
from cdcd.retry import Backoff, RetriesExhausted, retry_until

Address = tuple[int, int, int]
"""``(segment, offset, entry_index)`` of the last entry in Kafka (inclusive: that entry is sent)."""


class OpenTransaction(msgspec.Struct, frozen=True):
    """What was sent of the node transaction the stored position is inside (BEGIN sent, END not)."""

    events: int
    collections: dict[str, int]


class Stored(msgspec.Struct, frozen=True, omit_defaults=True):
    segment: int
    offset: int
    entry_index: int
    node: str = ""
    tx_events: int = 0
    tx_collections: dict[str, int] = msgspec.field(default_factory=dict)
    generation: int = 0
    """The source's generation: one more each time its WAL turned out to be another history
    (a node dir restored from a backup reuses positions Kafka already holds)."""
    commit_ts_ns: int = 0
    """Commit time of the stored entry's node transaction (0: stored before cdcd kept it)."""
    format: int = 0
    """The record's format version (``cdcd.formats.KAFKA_OFFSETS``; 0: none, written by v0.1.0: version 1)."""

    @property
    def address(self) -> Address:
        return (self.segment, self.offset, self.entry_index)

    @property
    def open_transaction(self) -> OpenTransaction | None:
        return OpenTransaction(self.tx_events, self.tx_collections) if self.tx_events else None


class _Versioned(msgspec.Struct):
    format: int = 0


_decode = msgspec.json.Decoder(Stored).decode
_decode_format = msgspec.json.Decoder(_Versioned).decode


def decode_record(value: bytes, where: str) -> Stored:
    """A record of the offsets topic, its format version checked first (a newer one may not decode as
    this code's ``Stored``): FormatTooNew names ``where``."""
    try:
        found = _decode_format(value).format
    except msgspec.DecodeError:
        found = 0  # not even an object: the full decode below says what is wrong
    formats.check(formats.KAFKA_OFFSETS, found or None, where)
    return _decode(value)


_encode = msgspec.json.Encoder().encode


def partition_of(node: str, partitions: int) -> int:
    """The offsets topic partition of a node's record (explicit: librdkafka's and Java's default
    partitioners differ)."""
    return zlib.crc32(node.encode()) % partitions


def encode(node: str, address: Address, open_tx: OpenTransaction | None = None) -> bytes:
    return _encode(stored(node, address, open_tx))


def stored(
    node: str, address: Address, open_tx: OpenTransaction | None, generation: int = 0, commit_ts_ns: int = 0
) -> Stored:
    events, collections = (open_tx.events, open_tx.collections) if open_tx is not None else (0, {})
    return Stored(*address, node, events, collections, generation, commit_ts_ns, formats.KAFKA_OFFSETS.current)


def encode_stored(record: Stored) -> bytes:
    return _encode(record)


def diverged(record: Stored, address: Address, commit_ts_ns: int) -> bool:
    """Whether an entry at or below the stored position is of another history than the one Kafka
    holds: committed after the stored entry, or at its record with another commit time. A node's
    records get their commit time from the clock as they are written, so a node dir restored from
    a backup writes its new records at old positions with newer times; replayed records of the
    same history (a crash between Kafka's commit and the daemon's) keep theirs. Not decidable for
    a position stored without a commit time (before cdcd kept it): never diverged."""
    if not record.commit_ts_ns:
        return False
    if commit_ts_ns > record.commit_ts_ns:
        return True
    return address[:2] == record.address[:2] and commit_ts_ns != record.commit_ts_ns


def read_position(conf: dict[str, Any], topic: str, partitions: int, node: str, timeout_s: float) -> Address | None:
    """The newest committed position of ``node`` (None: it never delivered)."""
    stored = read_stored(conf, topic, partitions, node, timeout_s)
    return None if stored is None else stored.address


class _Settling(Exception):
    """A watermark probe's retriable error (a topic just created, a leader moving): waited out."""

    def __init__(self, error: KafkaException) -> None:
        super().__init__(str(error))
        self.error = error


_SETTLING_BACKOFF = Backoff(initial_ms=200, max_ms=200)
_SETTLING_CODES = frozenset(
    {
        KafkaError._TIMED_OUT,
        # librdkafka does not mark these retriable for a watermark query, though a leader election ends them
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
    }
)


def read_stored(conf: dict[str, Any], topic: str, partitions: int, node: str, timeout_s: float) -> Stored | None:
    """The newest committed record of ``node`` (None: it never delivered).

    Reads the node's partition to its end as it was when called: up to the high watermark of
    everything written, committed or not, so a transaction still open elsewhere on the partition
    (another node's) is waited for rather than stopping the read before this node's newest record.
    """
    part = partition_of(node, partitions)
    tp = TopicPartition(topic, part)
    base = {**conf, "group.id": "cdcd-offsets-reader", "enable.auto.commit": False}
    deadline = time.monotonic() + timeout_s

    def high_watermark() -> int:
        # a new client per attempt: one that timed out against a dead leader may keep asking it
        probe = Consumer({**base, "isolation.level": "read_uncommitted"})
        try:
            _low, high = probe.get_watermark_offsets(tp, timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            return int(high)
        except KafkaException as exc:
            # a topic just created, a leader moving or down: its metadata settles in a moment
            err = exc.args[0]
            if err.retriable() or err.code() in _SETTLING_CODES:
                raise _Settling(exc) from exc
            raise
        finally:
            probe.close()

    try:
        high = retry_until(high_watermark, timeout_s, _SETTLING_BACKOFF, retriable=(_Settling,))
    except RetriesExhausted as exc:
        raise (exc.last.error if isinstance(exc.last, _Settling) else exc.last) from None
    if high <= 0:
        return None
    reader = Consumer({**base, "isolation.level": "read_committed", "enable.partition.eof": True})
    found: Stored | None = None
    key = node.encode()
    try:
        reader.assign([TopicPartition(topic, part, OFFSET_BEGINNING)])
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"offsets topic {topic} partition {part}: not read to offset {high} in {timeout_s:g} s "
                    "(a transaction left open?)"
                )
            msg = reader.poll(min(remaining, 1.0))
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    if (msg.offset() or 0) >= high:
                        return found
                    continue
                raise KafkaException(err)
            if msg.key() == key:
                value = msg.value()
                where = f"offsets topic {topic} partition {part} offset {msg.offset()} (node {node})"
                found = None if value is None else decode_record(value, where)
            if (msg.offset() or 0) + 1 >= high:
                return found
    finally:
        reader.close()
