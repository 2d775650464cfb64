"""Topic names of the per-cache mode (``topic_prefix``): ``<prefix>.<cache>``, as Debezium names a
table's topic ``<topic.prefix>.<schema>.<table>``.

Kafka allows ``[a-zA-Z0-9._-]`` in topic names, at most 249 characters. A cache name made of those
characters is its own suffix, unless it holds an underscore followed by two lowercase hex digits
(``_2f``). Any other name is escaped: every byte of its UTF-8 outside ``[a-zA-Z0-9.-]`` — the
underscore included — becomes ``_`` and two lowercase hex digits (``"a b"`` → ``a_20b``,
``"x_1f"`` → ``x_5f1f``). Collision-free: an escaped suffix always holds an underscore and every
underscore in it starts such an escape, which no unescaped suffix holds, and escaping is
reversible (``cache_of``). A name whose topic would be longer than 249 characters has no topic:
the sink fails on it with one line (shorten the prefix or the cache name).
"""

from __future__ import annotations

import re

from cdcd.kafka.options import KafkaSinkOptions

MAX_TOPIC_CHARS = 249
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
_ESCAPE = re.compile(r"_[0-9a-f]{2}")
_KEPT = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")


class TopicNameError(ValueError):
    """A cache without a topic of its own: the one line names the setting to change."""


def suffix_of(cache: str) -> str:
    """The topic name part of a cache name (see the module docstring)."""
    if _PLAIN_NAME.fullmatch(cache) and _ESCAPE.search(cache) is None:
        return cache
    return "".join(chr(b) if b in _KEPT else f"_{b:02x}" for b in cache.encode())


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
    return "topic" if topic == opts.topic else named.get(topic, "topic_prefix")


def cache_topic(opts: KafkaSinkOptions, cache: str) -> str:
    """The topic of ``cache`` with ``topic_prefix``; TopicNameError naming the setting to change
    when it is too long or is one of the sink's other topics."""
    topic = f"{opts.topic_prefix}.{suffix_of(cache)}"
    if len(topic) > MAX_TOPIC_CHARS:
        raise TopicNameError(
            f"key 'topic_prefix': cache {cache!r}: its topic {topic[:60]}... would have {len(topic)} characters, "
            f"Kafka allows {MAX_TOPIC_CHARS} (shorten topic_prefix or the cache name)"
        )
    others = {opts.metadata_topic_name: "metadata_topic", opts.offsets_topic: "offsets_topic"}
    if opts.transaction_metadata:
        others[opts.transaction_topic_name] = "transaction_topic"
    if topic in others:
        raise TopicNameError(
            f"key '{others[topic]}': cache {cache!r} has the topic {topic}: give {others[topic]} another name"
        )
    return topic
