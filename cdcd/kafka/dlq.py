"""The values of ``<topic>.dlq``: a change its topic refused (too large), kept with why."""

from __future__ import annotations

import msgspec

from cdcd.consumer import CdcEvent


class DeadLetter(msgspec.Struct, frozen=True, omit_defaults=True):
    """The refused change: its position, cache, op, the topic that refused it, why, and its message's
    key and value as they would have been sent (``value`` None: too large even here, ``value_bytes``
    says how large; the record's ``cdcd.entry`` header then still holds the change if it fits)."""

    pos: tuple[int, int, int]
    cache: str
    op: str
    topic: str
    error: str
    key: msgspec.Raw
    value: msgspec.Raw | None
    value_bytes: int = 0


def dlq_record(ev: CdcEvent, topic: str, error: str, *, key: bytes, value: bytes, max_bytes: int) -> bytes:
    """The JSON value of ``ev``'s dead letter, at most ``max_bytes`` unless even its value-less form is larger."""
    pos = ev.position
    record = DeadLetter(
        (pos.segment, pos.offset, pos.entry_index),
        ev.cache_name,
        ev.op_name,
        topic,
        error,
        msgspec.Raw(key),
        msgspec.Raw(value),
    )
    data = msgspec.json.encode(record)
    if len(data) > max_bytes:
        data = msgspec.json.encode(msgspec.structs.replace(record, value=None, value_bytes=len(value)))
    return data
