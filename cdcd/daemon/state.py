"""The daemon's durable state in LMDB: position, mode and cache registry.

One synced write transaction per commit; links are deleted only after it returns.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import lmdb
import msgspec

from cdcd.wal.pointer import WalPosition
from cdcd.wal.records import CacheInfo


class Mode(enum.Enum):
    ACTIVE = "ACTIVE"
    """The daemon delivers."""
    PASSIVE = "PASSIVE"
    """The node's realtime worker delivers; the daemon follows markers and deletes links."""


class DaemonState(msgspec.Struct, frozen=True):
    """``position``: every entry before it is committed (None: nothing yet, start at the oldest link)."""

    mode: Mode
    position: WalPosition | None = None
    updated_ns: int = 0
    commits: int = 0


_enc = msgspec.msgpack.Encoder()
_state_dec = msgspec.msgpack.Decoder(DaemonState)
_cache_dec = msgspec.msgpack.Decoder(CacheInfo)

STATE_MAP_SIZE_BYTES = 256 << 20


class StateStore:
    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        if not readonly:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        elif not (path / "data.mdb").exists():
            raise FileNotFoundError(f"no daemon state in {path}")
        self.env = lmdb.open(str(path), map_size=STATE_MAP_SIZE_BYTES, max_dbs=2, mode=0o600, readonly=readonly)
        try:
            self._state_db = self.env.open_db(b"state", create=not readonly)
            self._caches_db = self.env.open_db(b"caches", create=not readonly)
        except lmdb.NotFoundError:  # a daemon is creating its state right now
            self.env.close()
            raise FileNotFoundError(f"no daemon state in {path} yet") from None

    def close(self) -> None:
        self.env.close()

    def load(self, initial_mode: Mode) -> DaemonState:
        with self.env.begin(db=self._state_db) as txn:
            raw = txn.get(b"state")
        return _state_dec.decode(raw) if raw is not None else DaemonState(initial_mode)

    def caches(self) -> dict[int, CacheInfo]:
        with self.env.begin(db=self._caches_db) as txn:
            return {info.cache_id: info for info in (_cache_dec.decode(v) for _k, v in txn.cursor())}

    def commit(
        self,
        state: DaemonState,
        *,
        caches: Mapping[int, CacheInfo] | None = None,
        destroyed: Iterable[int] = (),
    ) -> DaemonState:
        """Persist ``state`` (and registry changes) in one synced transaction; returns what was written."""
        state = msgspec.structs.replace(state, updated_ns=time.time_ns(), commits=state.commits + 1)
        with self.env.begin(write=True) as txn:
            txn.put(b"state", _enc.encode(state), db=self._state_db)
            for info in (caches or {}).values():
                txn.put(info.cache_id.to_bytes(4, "big"), _enc.encode(info), db=self._caches_db)
            for cache_id in destroyed:
                txn.delete(cache_id.to_bytes(4, "big"), db=self._caches_db)
        return state
