"""Topic names of the per-cache mode (``topic_prefix``): ``<prefix>.<cache>``, as Debezium names a
table's topic ``<topic.prefix>.<schema>.<table>``; the dead letters of a topic go to ``<topic>.dlq``.

Kafka allows ``[a-zA-Z0-9._-]`` in topic names, at most 249 characters, and refuses to create a
topic whose name equals an existing one's once ``.`` and ``_`` are taken as the same character
(``fold``): ``p.a.b`` and ``p.a_b`` cannot both exist. So a cache's topic suffix holds no ``.``:

- a name of ``[a-zA-Z0-9_-]`` is its own suffix, unless it holds an underscore followed by two
  lowercase hex digits (``_2f``) or ends in ``_dlq`` (the folded form of a dead-letter topic);
- any other name is escaped: every byte of its UTF-8 outside ``[a-zA-Z0-9-]`` (``.`` and ``_``
  included) becomes ``_`` and two lowercase hex digits (``a.b`` -> ``a_2eb``, ``"a b"`` ->
  ``a_20b``, ``x_1f`` -> ``x_5f1f``, ``x_dlq`` -> ``x_5fdlq``).

No two caches' topics fold alike: suffixes hold no ``.``, an escaped suffix always holds an
underscore and every underscore in it starts an escape, which no unescaped suffix holds, and
escaping is reversible (``cache_of``). No cache's topic folds like another cache's dead-letter
topic either: that would take a suffix ending in ``_dlq``, which is escaped, and an escaped one
cannot end so (``_dl`` is no escape). The sink's own topics are configured names: a cache whose
topic or dead-letter topic folds like one of them (a cache ``transaction`` with
``transaction_metadata`` on) has its first byte escaped as well (``p._74ransaction``), a suffix
no other cache has (an ordinary escape keeps that byte). The answer depends on the cache name
and the settings alone, never on which caches exist or came first.

A name whose topic would be longer than 249 characters has no topic: the sink fails on it with
one line (shorten the prefix or the cache name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import structlog
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from cdcd.kafka.errors import KafkaSetupError, describe, error_of
from cdcd.kafka.options import KafkaSinkOptions
from cdcd.retry import poll_until

log = structlog.get_logger("cdcd.kafka.sink")

MAX_TOPIC_CHARS = 249
DLQ_SUFFIX = ".dlq"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPE = re.compile(r"_[0-9a-f]{2}")
_KEPT = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


class TopicNameError(ValueError):
    """A cache without a topic of its own: the one line names the setting to change."""


def fold(topic: str) -> str:
    """A topic name as Kafka compares it with existing ones (``.`` and ``_`` alike)."""
    return topic.replace(".", "_")


def dlq_topic(topic: str) -> str:
    """The dead-letter topic of a data topic."""
    return topic + DLQ_SUFFIX


def is_cache_topic(prefix: str, topic: str) -> bool:
    """Whether ``topic`` is a cache's topic of ``prefix`` (``<prefix>.<suffix>``, the suffix without a ``.``): not a
    dead-letter topic ``<prefix>.<suffix>.dlq``, which holds the changes set aside for an operator."""
    suffix = topic.removeprefix(f"{prefix}.")
    return suffix != topic and bool(suffix) and "." not in suffix


def suffix_of(cache: str) -> str:
    """The topic name part of a cache name (see the module docstring)."""
    if _PLAIN_NAME.fullmatch(cache) and _ESCAPE.search(cache) is None and not cache.endswith("_dlq"):
        return cache
    return _escaped(cache)


def _escaped(cache: str, *, first: bool = False) -> str:
    """``cache`` with every byte outside ``[a-zA-Z0-9-]`` escaped; ``first``: its first byte too."""
    return "".join(
        chr(b) if b in _KEPT and not (first and i == 0) else f"_{b:02x}" for i, b in enumerate(cache.encode())
    )


def cache_of(suffix: str) -> str:
    """The cache name of a topic suffix (the inverse of ``suffix_of``)."""
    if "_" not in suffix or _ESCAPE.search(suffix) is None:
        return suffix
    return re.sub(rb"_([0-9a-f]{2})", lambda m: bytes.fromhex(m.group(1).decode()), suffix.encode()).decode()


def setting_of(topic: str, opts: KafkaSinkOptions) -> str:
    """The setting that names a topic of this sink."""
    named = {
        opts.metadata_topic_name: "metadata_topic",
        opts.offsets_topic: "offsets_topic",
        opts.transaction_topic_name: "transaction_topic",
    }
    return "topic" if opts.topic and topic in (opts.topic, dlq_topic(opts.topic)) else named.get(topic, "topic_prefix")


class CacheTopic(NamedTuple):
    topic: str
    avoided: str
    """The setting whose topic the plain name would have folded like ("" when none)."""


def sink_topics(opts: KafkaSinkOptions) -> dict[str, str]:
    """The sink's own topics besides the data topics, folded, with the setting naming each."""
    named = {opts.metadata_topic_name: "metadata_topic", opts.offsets_topic: "offsets_topic"}
    if opts.transaction_metadata:
        named[opts.transaction_topic_name] = "transaction_topic"
    return {fold(name): key for name, key in named.items()}


def cache_topic(opts: KafkaSinkOptions, cache: str) -> CacheTopic:
    """The topic of ``cache`` with ``topic_prefix`` (see the module docstring); TopicNameError
    naming the setting to change when it is too long, or when even its first-byte-escaped form
    folds like one of the sink's other topics."""
    others = sink_topics(opts)

    def clash(topic: str) -> str:
        return others.get(fold(topic)) or others.get(fold(dlq_topic(topic))) or ""

    topic = f"{opts.topic_prefix}.{suffix_of(cache)}"
    avoided = clash(topic)
    if avoided:
        renamed = f"{opts.topic_prefix}.{_escaped(cache, first=True)}"
        if renamed == topic or clash(renamed):
            key = clash(renamed) or avoided
            raise TopicNameError(
                f"key '{key}': cache {cache!r}: its topic {renamed} or its dead letters' {dlq_topic(renamed)} "
                f"would be the {key} (Kafka takes '.' and '_' alike in topic names): give {key} another name"
            )
        topic = renamed
    if len(topic) > MAX_TOPIC_CHARS:
        raise TopicNameError(
            f"key 'topic_prefix': cache {cache!r}: its topic {topic[:60]}... would have {len(topic)} characters, "
            f"Kafka allows {MAX_TOPIC_CHARS} (shorten topic_prefix or the cache name)"
        )
    return CacheTopic(topic, avoided)


def ensure_topics(
    admin: AdminClient, wanted: Mapping[str, tuple[int, dict[str, str]]], opts: KafkaSinkOptions, source: str
) -> None:
    """Create the topics that are missing; an existing data topic must have enough partitions."""
    timeout_s = opts.connect_timeout_ms / 1000
    try:
        meta = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise KafkaSetupError(
            f"{source}: key 'bootstrap_servers': cannot reach {opts.bootstrap_servers} "
            f"in {timeout_s:g} s: {describe(exc)}"
        ) from None
    missing = [
        NewTopic(name, parts, opts.replication_factor, config=config)
        for name, (parts, config) in wanted.items()
        if name not in meta.topics
    ]
    if missing:
        for name, fut in admin.create_topics(missing, request_timeout=timeout_s).items():
            try:
                fut.result()
            except KafkaException as exc:
                err = error_of(exc)
                if err is not None and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # another process made it meanwhile
                key = setting_of(name, opts)
                why = describe(exc)
                if "collides with existing topic" in why:
                    why += (
                        " (Kafka takes '.' and '_' alike in topic names; cdcd names no two of its topics so: that one "
                        "is not this sink's, or is a dotted cache's topic from before cdcd 0.2.0: delete it once read)"
                    )
                raise KafkaSetupError(f"{source}: key '{key}': cannot create topic {name}: {why}") from None
            log.info("kafka_topic_created", topic=name, partitions=wanted[name][0])
        meta = settled(admin, [t.topic for t in missing], opts, source)
    for name, (parts, _config) in wanted.items():
        data = meta.topics.get(name)
        if data is not None and data.error is None and len(data.partitions) < parts:
            raise KafkaSetupError(
                f"{source}: key 'topic_partitions': topic {name} has {len(data.partitions)} partitions, "
                f"fewer than topic_partitions = {opts.topic_partitions}"
            )


def max_message_bytes(admin: AdminClient, topic: str, opts: KafkaSinkOptions) -> int:
    """The largest message ``topic`` takes: its ``max.message.bytes`` (the broker's default when the
    topic sets none), and never more than the producer's ``max_message_bytes``. A cluster that does
    not tell (no DescribeConfigs right) leaves ``max_message_bytes``: a larger message then fails its
    batch at the broker, as it did before dead letters."""
    resource = ConfigResource("topic", topic)
    try:
        future = admin.describe_configs([resource], request_timeout=opts.connect_timeout_ms / 1000)[resource]
        value = int(future.result()["max.message.bytes"].value)
    except (KafkaException, KeyError, ValueError) as exc:
        log.warning(
            "kafka_topic_limit_unknown",
            topic=topic,
            error=describe(exc) if isinstance(exc, KafkaException) else repr(exc),
        )
        return opts.max_message_bytes
    return min(value, opts.max_message_bytes)


def settled(admin: AdminClient, topics: Sequence[str], opts: KafkaSinkOptions, source: str) -> Any:
    """Cluster metadata once every topic of ``topics`` shows its partitions without an error: right
    after a topic is created, the broker may still answer with none of them (or with
    LEADER_NOT_AVAILABLE). KafkaSetupError if that lasts ``connect_timeout_ms`` (the sink does not
    start; a restart, as systemd's, tries again)."""
    pending: list[str] = list(topics)
    found: dict[str, Any] = {}

    def settled_meta() -> Any:
        nonlocal pending, found
        try:
            meta = admin.list_topics(timeout=opts.connect_timeout_ms / 1000)
        except KafkaException as exc:
            names = ", ".join(topics)
            raise KafkaSetupError(f"{source}: key 'bootstrap_servers': metadata of {names}: {describe(exc)}") from None
        found = meta.topics
        pending = [t for t in topics if t not in found or found[t].error or not found[t].partitions]
        return None if pending else meta

    meta = poll_until(settled_meta, opts.connect_timeout_ms / 1000, 0.1)
    if meta is None:
        why = "; ".join(f"{t}: {found[t].error}" for t in pending if t in found and found[t].error)
        raise KafkaSetupError(
            f"{source}: topic(s) {', '.join(pending)} without partitions in the cluster's metadata after "
            f"connect_timeout_ms = {opts.connect_timeout_ms}" + (f" ({why})" if why else "") + " (just created, "
            "the broker may still be electing leaders: start again)"
        )
    return meta
