"""The node's metastorage: a small LMDB env of its own for the realtime state and node-wide switches."""

from __future__ import annotations

import time
from pathlib import Path

import lmdb
import msgspec

from cdcd import failpoints, formats
from cdcd.daemon_state import StateDamaged, check_lmdb_file
from cdcd.wal.pointer import WalPointer, WalPosition


class RealtimeState(msgspec.Struct, frozen=True):
    """What the metastorage keeps: the committed position, whether realtime is on, a pending try-start."""

    enabled: bool = False
    position: WalPosition | None = None
    try_start: WalPointer | None = None
    updated_ns: int = 0
    last_delivered: WalPointer | None = None
    """The last data record the consumer confirmed (the position alone cannot say: markers move it too)."""


FORMAT_KEY = b"format"
"""The key of the format version (``cdcd.formats.METASTORAGE``; absent: 1, as v0.1.0 wrote)."""


def _format_of(txn: lmdb.Transaction, data: Path) -> int:
    """The metastorage's format version, refused when newer than this code's."""
    raw = txn.get(FORMAT_KEY)
    try:
        found = None if raw is None else formats.parse_version(raw)
    except ValueError as exc:
        raise MetastorageUnreadable(f"{data}: {exc}") from None
    return formats.check(formats.METASTORAGE, found, str(data))


class Metastorage:
    """A small LMDB env of its own, so realtime commits never queue behind a checkpoint's write txn."""

    _KEY = b"realtime"

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.env = lmdb.open(str(path), map_size=64 << 20, max_dbs=1, mode=0o600)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(RealtimeState)
        try:
            self.format = self._mark_format(path / "data.mdb")
        except BaseException:
            self.env.close()
            raise

    def _mark_format(self, data: Path) -> int:
        """Check the format; an unmarked metastorage (v0.1.0's, or a new one) is marked in one synced
        transaction: a crash leaves it unmarked or marked, nothing else changed."""
        with self.env.begin() as txn:
            found = _format_of(txn, data)
            if txn.get(FORMAT_KEY) is not None:
                return found
        with self.env.begin(write=True) as txn:
            txn.put(FORMAT_KEY, str(formats.METASTORAGE.current).encode())
            failpoints.hit("formats.metastorage.marking")
        return formats.METASTORAGE.current

    def get(self) -> RealtimeState | None:
        with self.env.begin() as txn:
            raw = txn.get(self._KEY)
        return self._dec.decode(raw) if raw is not None else None

    def put(self, state: RealtimeState) -> None:
        state = msgspec.structs.replace(state, updated_ns=time.time_ns())
        with self.env.begin(write=True) as txn:
            txn.put(self._KEY, self._enc.encode(state))

    def get_flag(self, key: bytes) -> bool | None:
        """A node-wide switch kept next to the realtime state (None: never set)."""
        with self.env.begin() as txn:
            raw = txn.get(key)
        return None if raw is None else raw == b"1"

    def put_flag(self, key: bytes, value: bool) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, b"1" if value else b"0")

    def close(self) -> None:
        self.env.close()


class MetastorageUnreadable(Exception):
    """The metastorage's file is damaged or cannot be opened; the message names it."""


def read_realtime_state(path: Path) -> RealtimeState | None:
    """The realtime state a node's metastorage at ``path`` holds, read-only, for another process (a daemon
    without a state of its own): None when the node never wrote one (no metastorage, or nothing in it)."""
    data = path / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:
        return None
    try:
        check_lmdb_file(data)
        env = lmdb.open(str(path), readonly=True, max_dbs=1)
    except (StateDamaged, lmdb.Error) as exc:
        raise MetastorageUnreadable(f"{data}: {exc}") from None
    try:
        with env.begin() as txn:
            _format_of(txn, data)
            raw = txn.get(Metastorage._KEY)
        return msgspec.msgpack.decode(raw, type=RealtimeState) if raw is not None else RealtimeState()
    except (lmdb.Error, msgspec.DecodeError) as exc:
        raise MetastorageUnreadable(f"{data}: {exc}") from None
    finally:
        env.close()
