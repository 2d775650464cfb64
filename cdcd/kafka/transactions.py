"""Node transactions as Debezium's transaction metadata: the ``transaction`` block of each event
and, with ``transaction_topic``, BEGIN/END records (``<prefix>.transaction``).

A node transaction is one WAL record; its id is ``<node>:<segment>:<offset>``. Only the events the
sink sends count (primaries of the selected caches): ``total_order`` is an event's rank among
them, ``data_collection_order`` its rank among those of its data collection (``<db>.<cache>``),
and END's ``event_count`` their number. BEGIN goes out in the Kafka transaction of the record's
first sent event, END in that of its last entry; a record cut by ``max_events_per_transaction``
leaves its counts in the stored position (``offsets.OpenTransaction``), so a new producer, after a
crash too, continues them. A record none of whose events is sent has neither record.
"""

from __future__ import annotations

from typing import Any

import msgspec

from cdcd.kafka.offsets import OpenTransaction, Stored

_encode = msgspec.json.Encoder().encode

Pointer = tuple[int, int]


class _Collection(msgspec.Struct):
    data_collection: str
    event_count: int


class _Record(msgspec.Struct):
    status: str
    id: str
    event_count: int | None
    data_collections: list[_Collection] | None
    ts_ms: int


class _Key(msgspec.Struct):
    id: str


def _opt(field: str, type_: str) -> dict[str, Any]:
    return {"type": type_, "optional": True, "field": field}


_VALUE_SCHEMA = {
    "type": "struct",
    "name": "io.debezium.connector.common.TransactionMetadataValue",
    "optional": False,
    "fields": [
        {"type": "string", "optional": False, "field": "status"},
        {"type": "string", "optional": False, "field": "id"},
        _opt("event_count", "int64"),
        {
            "type": "array",
            "optional": True,
            "field": "data_collections",
            "items": {
                "type": "struct",
                "optional": False,
                "fields": [
                    {"type": "string", "optional": False, "field": "data_collection"},
                    {"type": "int64", "optional": False, "field": "event_count"},
                ],
            },
        },
        {"type": "int64", "optional": False, "field": "ts_ms"},
    ],
}
_KEY_SCHEMA = {
    "type": "struct",
    "name": "io.debezium.connector.common.TransactionMetadataKey",
    "optional": False,
    "fields": [{"type": "string", "optional": False, "field": "id"}],
}


def key_bytes(tx_id: str, schemas: bool) -> bytes:
    if schemas:
        return _encode({"schema": _KEY_SCHEMA, "payload": _Key(tx_id)})
    return _encode(_Key(tx_id))


def record_bytes(status: str, tx_id: str, ts_ms: int, open_tx: OpenTransaction | None, schemas: bool) -> bytes:
    """A BEGIN (``open_tx`` None) or END record."""
    if open_tx is None:
        rec = _Record(status, tx_id, None, None, ts_ms)
    else:
        counts = [_Collection(name, n) for name, n in open_tx.collections.items()]
        rec = _Record(status, tx_id, open_tx.events, counts, ts_ms)
    if schemas:
        return _encode({"schema": _VALUE_SCHEMA, "payload": rec})
    return _encode(rec)


class Tracker:
    """The ranks of one Kafka transaction's events within their node transactions, and when
    BEGIN and END fall due. Starts from the committed state; the caller keeps ``state()`` only
    once the Kafka transaction committed."""

    def __init__(self, at: Pointer | None, open_tx: OpenTransaction | None) -> None:
        self._record: Pointer | None = at if open_tx is not None else None
        self._events = open_tx.events if open_tx is not None else 0
        self._collections: dict[str, int] = dict(open_tx.collections) if open_tx is not None else {}

    @classmethod
    def resume(cls, stored: Stored | None) -> Tracker:
        """From the source's stored position (None: nothing stored)."""
        if stored is None:
            return cls(None, None)
        return cls(stored.address[:2], stored.open_transaction)

    @property
    def record(self) -> Pointer | None:
        """The node transaction with events sent and its END not yet due."""
        return self._record

    def event(self, record: Pointer, collection: str) -> tuple[bool, int, int]:
        """A sent event: (BEGIN due first, total_order, data_collection_order). A record other
        than the open one must have been ended (``end``) before."""
        begin = self._record != record
        if begin:
            assert self._record is None, "the previous node transaction was not ended"
            self._record, self._events, self._collections = record, 0, {}
        self._events += 1
        order = self._collections[collection] = self._collections.get(collection, 0) + 1
        return begin, self._events, order

    def end(self) -> OpenTransaction | None:
        """The open node transaction is over: its counts for END (None: none was open)."""
        if self._record is None:
            return None
        done = OpenTransaction(self._events, self._collections)
        self._record, self._events, self._collections = None, 0, {}
        return done

    def state(self) -> OpenTransaction | None:
        """What to store with the position (None: no node transaction left open)."""
        if self._record is None:
            return None
        return OpenTransaction(self._events, dict(self._collections))
