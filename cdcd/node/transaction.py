"""Multi-cache transactions: all writes land as one DataRecord, or none does."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from cdcd.node.writes import REMOVE
from cdcd.wal.records import CacheInfo

if TYPE_CHECKING:
    from cdcd.node.node import Node


class Transaction:
    """Collects writes; commits on a clean exit from ``with``, discards them on an exception."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._writes: list[tuple[CacheInfo, Any, Any, int | None]] = []
        self._done = False

    def put(self, cache: str, key: Any, value: Any, *, ttl_ms: int | None = None) -> None:
        """``ttl_ms`` as in ``Cache.put``, counted from the commit."""
        self._writes.append((self._node.cache(cache).info, key, value, ttl_ms))

    def remove(self, cache: str, key: Any) -> None:
        self._writes.append((self._node.cache(cache).info, key, REMOVE, None))

    def get(self, cache: str, key: Any, default: Any = None) -> Any:
        """Sees this transaction's own writes first."""
        info = self._node.cache(cache).info
        for winfo, wkey, value, _ttl in reversed(self._writes):
            if winfo.cache_id == info.cache_id and wkey == key:
                return default if value is REMOVE else value
        return self._node.writes.get(info, key, default)

    def commit(self) -> int:
        """Write everything as one DataRecord; returns the number of entries written. A refused key or
        value (``ValueRefused``) writes nothing, and the transaction is finished."""
        if self._done:
            raise RuntimeError("transaction already finished")
        self._done = True
        return self._node.writes.commit(self._writes)

    def rollback(self) -> None:
        self._done = True
        self._writes.clear()

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            if not self._done:
                self.commit()
        else:
            self.rollback()
