"""Consumers chosen by ``[consumer] kind`` (the daemon and the node's realtime worker share them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from cdcd.config import CACHE_FILTER_KEYS, CacheFilter, ConfigError
from cdcd.consumer import DEFAULT_RETRY_TIMEOUT_S, Consumer

COMMON_KEYS = ("kind", "retry_timeout_s", *CACHE_FILTER_KEYS)
"""Keys of every ``[consumer]`` table, read here (the rest goes to the kind's own options)."""

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
    from cdcd.sinks.lake import LakeConsumer

    return LakeConsumer.from_options(options, source)


KINDS: dict[str, ConsumerFactory] = {
    "jsonl": _jsonl,
    "kafka": _kafka,
    "lake": _lake,
    "null": _null,
    "python": _python,
    "replication": _replication,
}


def load_consumer(table: Mapping[str, Any], source: str = "consumer") -> Consumer:
    """Build the consumer a ``[consumer]`` table describes; errors name ``source`` and the key.

    ``caches`` and ``exclude_caches`` are checked here but are not the consumer's: whoever delivers
    to it (the daemon, the node's realtime worker) applies them to the batches (``CacheFilter``)."""
    kind = table.get("kind")
    if kind is None:
        raise ConfigError(f"{source}: missing key 'kind' (one of: {', '.join(sorted(KINDS))})")
    factory = KINDS.get(kind)
    if factory is None:
        raise ConfigError(f"{source}: key 'kind': unknown consumer kind {kind!r} (one of: {', '.join(sorted(KINDS))})")
    CacheFilter.from_table(table, source)
    retry_timeout_s = _retry_timeout_s(table, source)
    options = {k: v for k, v in table.items() if k not in COMMON_KEYS}
    consumer = factory(options, source)
    try:
        consumer.retry_timeout_s = retry_timeout_s
    except AttributeError:  # a user class with __slots__ and no such slot
        raise ConfigError(
            f"{source}: key 'class': {type(consumer).__name__} cannot take retry_timeout_s "
            "(subclass cdcd.consumer.Consumer)"
        ) from None
    return consumer


def _retry_timeout_s(table: Mapping[str, Any], source: str) -> float:
    """``retry_timeout_s``, every kind's: how long a transient failure is retried before the consumer fails."""
    if "max_retry_s" in table:
        raise ConfigError(f"{source}: key 'max_retry_s' is now 'retry_timeout_s' (one option for every consumer kind)")
    value = table.get("retry_timeout_s", DEFAULT_RETRY_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{source}: key 'retry_timeout_s': {value!r}: must be a finite number of seconds >= 0")
    return float(value)
