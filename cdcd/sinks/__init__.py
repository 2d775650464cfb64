"""Consumers chosen by ``[consumer] kind`` (the daemon and the node's realtime worker share them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from cdcd.config import CACHE_FILTER_KEYS, CacheFilter, ConfigError, upgrade_table, with_known_keys
from cdcd.consumer import DEFAULT_RETRY_TIMEOUT_S, Consumer

COMMON_KEYS = (
    "kind",
    "retry_timeout_s",
    "dead_letters",
    "dead_letters_path",
    *CACHE_FILTER_KEYS,
    "start",
    "max_retained_bytes",
)
"""Keys of every ``[consumer]`` table, read here (the rest goes to the kind's own options). ``start`` and
``max_retained_bytes`` are the daemon's, checked where it reads its config (``cdcd.daemon.config.lane_policy``)."""

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


def load_consumer(table: Mapping[str, Any], source: str = "consumer") -> Consumer:
    """Build the consumer a ``[consumer]`` table describes; errors name ``source`` and the key.

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
    retry_timeout_s = _retry_timeout_s(table, source)
    dead_letters, dead_letters_path = _dead_letters(table, kind, source)
    options = {k: v for k, v in table.items() if k not in COMMON_KEYS}
    try:
        consumer = factory(options, source)
    except ConfigError as exc:
        # The kind's options never see the common keys, of which a typo may be one.
        raise with_known_keys(exc, source, COMMON_KEYS) from None
    try:
        consumer.retry_timeout_s = retry_timeout_s
        if dead_letters:  # set only when on: a user class without the attributes still runs fail-fast
            consumer.dead_letters = True
            consumer.dead_letters_path = dead_letters_path
    except AttributeError:  # a user class with __slots__ and no such slot
        raise ConfigError(
            f"{source}: key 'class': {type(consumer).__name__} cannot take retry_timeout_s or dead_letters "
            "(subclass cdcd.consumer.Consumer)"
        ) from None
    return consumer


def _dead_letters(table: Mapping[str, Any], kind: str, source: str) -> tuple[bool, str]:
    """``dead_letters`` ("off" or "on") and, for kinds without a destination of their own, ``dead_letters_path``."""
    value = table.get("dead_letters", "off")
    if value not in ("off", "on"):
        raise ConfigError(f'{source}: key \'dead_letters\': {value!r}: must be "off" or "on"')
    path = table.get("dead_letters_path", "")
    if not isinstance(path, str):
        raise ConfigError(f"{source}: key 'dead_letters_path': {path!r}: must be a file path")
    if value == "off":
        if path:
            raise ConfigError(f"{source}: key 'dead_letters_path': set, but dead_letters is \"off\"")
        return False, ""
    if kind in NO_DEAD_LETTERS:
        raise ConfigError(f"{source}: key 'dead_letters': kind {kind!r} has no dead letters: {NO_DEAD_LETTERS[kind]}")
    if kind in NATIVE_DEAD_LETTERS:
        if path:
            raise ConfigError(
                f"{source}: key 'dead_letters_path': kind {kind!r} keeps dead letters in {NATIVE_DEAD_LETTERS[kind]}"
            )
    elif not path:
        raise ConfigError(
            f"{source}: key 'dead_letters_path': required with dead_letters = \"on\" for kind {kind!r} (a jsonl file)"
        )
    return True, path


def _retry_timeout_s(table: Mapping[str, Any], source: str) -> float:
    """``retry_timeout_s``, every kind's: how long a transient failure is retried before the consumer fails."""
    value = table.get("retry_timeout_s", DEFAULT_RETRY_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{source}: key 'retry_timeout_s': {value!r}: must be a finite number of seconds >= 0")
    return float(value)
