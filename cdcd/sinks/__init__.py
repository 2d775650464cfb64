"""Consumers chosen by ``[consumer] kind`` (the daemon and the node's realtime worker share them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cdcd.config import CACHE_FILTER_KEYS, CacheFilter, ConfigError, upgrade_table, with_known_keys
from cdcd.consumer import Consumer, DeliveryPolicy, LoadedConsumer, as_consumer

COMMON_KEYS = (
    "kind",
    "retry_timeout_s",
    "dead_letters",
    "dead_letters_path",
    *CACHE_FILTER_KEYS,
    "start",
    "max_retained_bytes",
    "catchup_max_share",
)
"""Keys of every ``[consumer]`` table, read here (the rest goes to the kind's own options). ``start``,
``max_retained_bytes`` and ``catchup_max_share`` are the daemon's, checked where it reads its config
(``cdcd.daemon.config.lane_policy``)."""

NATIVE_DEAD_LETTERS = {"kafka": "<topic>.dlq, in the same transaction as its batch"}
"""Kinds that keep dead letters themselves; the others get ``dead_letters_path`` (the delivery loop's file)."""
NO_DEAD_LETTERS = {"lake": "it refuses no single event (every value lands as JSON text; a failing store is retried)"}

ConsumerFactory = Callable[[Mapping[str, Any], str], Consumer]


def _jsonl(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.sinks.jsonl import JsonlConsumer

    return JsonlConsumer.from_options(options, source)


def _kafka(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.kafka.sink import load

    return load(options, source)


def _null(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.sinks.null import NullConsumer

    return NullConsumer.from_options(options, source)


def _python(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.sinks.python import load_python_consumer

    return load_python_consumer(options, source)


def _replication(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.sinks.replication import ReplicationConsumer

    return ReplicationConsumer.from_options(options, source)


def _lake(options: Mapping[str, Any], source: str) -> Consumer:
    from cdcd.lake.sink import LakeConsumer

    return LakeConsumer.from_options(options, source)


KINDS: dict[str, ConsumerFactory] = {
    "jsonl": _jsonl,
    "kafka": _kafka,
    "lake": _lake,
    "null": _null,
    "python": _python,
    "replication": _replication,
}


def load_consumer(table: Mapping[str, Any], source: str = "consumer") -> LoadedConsumer:
    """Build the consumer a ``[consumer]`` table describes, with its delivery policy (read here, once);
    errors name ``source`` and the key. A user class that does not subclass ``Consumer`` is wrapped
    (``cdcd.consumer.as_consumer``).

    ``caches`` and ``exclude_caches`` are checked here but are not the consumer's: whoever delivers
    to it (the daemon, the node's realtime worker) applies them to the batches (``CacheFilter``).
    Deprecated spellings are read as their new ones (``cdcd.config.DEPRECATED``)."""
    table = upgrade_table(table, "consumer", source)
    kind = table.get("kind")
    if kind is None:
        raise ConfigError(f"{source}: missing key 'kind' (one of: {', '.join(sorted(KINDS))})")
    factory = KINDS.get(kind)
    if factory is None:
        raise ConfigError(f"{source}: key 'kind': unknown consumer kind {kind!r} (one of: {', '.join(sorted(KINDS))})")
    CacheFilter.from_table(table, source)
    policy = delivery_policy(table, source)
    options = {k: v for k, v in table.items() if k not in COMMON_KEYS}
    try:
        consumer = as_consumer(factory(options, source))
    except ConfigError as exc:
        # The kind's options never see the common keys, of which a typo may be one.
        raise with_known_keys(exc, source, COMMON_KEYS) from None
    if kind in NATIVE_DEAD_LETTERS:
        consumer.dead_letters = table.get("dead_letters") == "on"
    return LoadedConsumer(consumer, policy)


def delivery_policy(table: Mapping[str, Any], source: str) -> DeliveryPolicy:
    """``DeliveryPolicy.from_table`` with the kind's rules on dead letters: ``dead_letters_path`` is
    required for kinds without a destination of their own and refused for the others."""
    policy = DeliveryPolicy.from_table(table, source)
    kind = table.get("kind", "")
    if table.get("dead_letters", "off") == "off":
        return policy
    if kind in NO_DEAD_LETTERS:
        raise ConfigError(f"{source}: key 'dead_letters': kind {kind!r} has no dead letters: {NO_DEAD_LETTERS[kind]}")
    if kind in NATIVE_DEAD_LETTERS:
        if policy.dead_letters_path:
            raise ConfigError(
                f"{source}: key 'dead_letters_path': kind {kind!r} keeps dead letters in {NATIVE_DEAD_LETTERS[kind]}"
            )
    elif not policy.dead_letters_path:
        raise ConfigError(
            f"{source}: key 'dead_letters_path': required with dead_letters = \"on\" for kind {kind!r} (a jsonl file)"
        )
    return policy
