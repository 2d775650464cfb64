"""A read-only view of a stopped node's data: the page store plus a WAL replay in memory.

``cdcd lake verify`` uses it, so checking a node never writes to it (no Stop record, no realtime
state change, no truncation, no checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from cdcd.lock import DirLock, LockHeld
from cdcd.node.config import NodeConfig
from cdcd.node.node import NodeLocked
from cdcd.node.recovery import recover
from cdcd.node.store import PageStore, cache_prefix
from cdcd.wal.records import CacheInfo, Op


class NodeSnapshot:
    """Holds the node's lock while open, so no node process changes the data under it."""

    def __init__(self, node_dir: str | Path) -> None:
        self.config = NodeConfig(node_dir=str(node_dir))
        self._lock = DirLock(self.config.lock_path)
        try:
            self._lock.acquire(0)
        except LockHeld as exc:
            raise NodeLocked(exc.path, exc.pid) from None
        try:
            self._store = PageStore(self.config.db_path, self.config.lmdb_map_size_bytes)
            self._purged: set[int] = set()
            state = recover(
                work_dir=self.config.wal_path,
                archive_dir=self.config.archive_path,
                checkpoint=self._store.checkpoint(),
                caches=self._store.caches(),
                purge_cache=lambda info: self._purged.add(info.cache_id),
                read_only=True,
            )
        except BaseException:
            self._lock.release()
            raise
        self._dirty = state.dirty
        self._caches: dict[str, CacheInfo] = state.caches

    def caches(self) -> list[str]:
        return sorted(self._caches)

    def cache_infos(self) -> dict[str, CacheInfo]:
        return dict(self._caches)

    def raw_items(self, cache: str) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) MessagePack bytes of every live entry, in key order; like a running node,
        an entry past its expire time is not live (whether or not its DELETE was written yet)."""
        info = self._caches.get(cache)
        if info is None:
            return
        prefix = cache_prefix(info.cache_id)
        merged: dict[bytes, tuple[bytes, int]] = {}
        if info.cache_id not in self._purged:
            merged = {k: (bytes(v.value), v.expire_time_ms) for k, v in self._store.items(info.cache_id)}
        for k, e in self._dirty.items():
            if k.startswith(prefix):
                if e.op == Op.DELETE:
                    merged.pop(k[len(prefix) :], None)
                else:
                    merged[k[len(prefix) :]] = (bytes(e.value), e.expire_time_ms)
        now_ms = time.time_ns() // 1_000_000
        for k in sorted(merged):
            value, expire = merged[k]
            if not 0 < expire <= now_ms:
                yield k, value

    def close(self) -> None:
        self._store.close()
        self._lock.release()

    def __enter__(self) -> NodeSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
