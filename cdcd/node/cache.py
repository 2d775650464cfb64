"""Cache handles: the user-facing key-value API of one cache."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from cdcd.node.writes import REMOVE
from cdcd.wal.records import CacheInfo

if TYPE_CHECKING:
    from cdcd.node.node import Node

_MISSING: Any = object()


class Cache:
    """A named cache of a node; every write is one WAL DataRecord (atomic on recovery)."""

    __slots__ = ("_node", "info")

    def __init__(self, node: Node, info: CacheInfo) -> None:
        self._node = node
        self.info = info

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def cache_id(self) -> int:
        return self.info.cache_id

    def __repr__(self) -> str:
        return f"Cache({self.info.name!r}, id={self.info.cache_id})"

    def put(self, key: Any, value: Any, *, ttl_ms: int | None = None) -> None:
        """Put ``value``; it expires ``ttl_ms`` after this call (None: the cache's ``ttl_ms``; 0:
        never). A later put sets the expiry anew. A key or value the node cannot store raises
        ``ValueRefused`` (naming this cache, the key and the limit), and nothing is written."""
        self._node.writes.put(self.info, key, value, ttl_ms)

    def put_all(self, items: Mapping[Any, Any], *, ttl_ms: int | None = None) -> None:
        """Every item in one DataRecord; one refused key or value (``ValueRefused``) writes none."""
        info = self.info
        self._node.writes.commit([(info, k, v, ttl_ms) for k, v in items.items()])

    def remove(self, key: Any) -> bool:
        """Remove ``key``; False if it was not there, or expired (nothing is written then)."""
        return self._node.writes.commit([(self.info, key, REMOVE, None)]) > 0

    def remove_all(self, keys: Iterable[Any]) -> int:
        """Remove the keys that exist; returns how many were removed."""
        info = self.info
        return self._node.writes.commit([(info, k, REMOVE, None) for k in keys])

    def get(self, key: Any, default: Any = None) -> Any:
        return self._node.writes.get(self.info, key, default)

    def __contains__(self, key: Any) -> bool:
        return self._node.writes.get(self.info, key, _MISSING) is not _MISSING

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Current (key, value) pairs, in key-byte order (a consistent view as of the call)."""
        return self._node._items(self.info)

    def __len__(self) -> int:
        return sum(1 for _ in self._node._items(self.info, decode=False))
