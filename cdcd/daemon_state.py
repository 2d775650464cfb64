"""The daemon's durable state in LMDB: position, mode and cache registry.

Below both the daemon (which writes it) and the node (whose status reads it).

One synced write transaction per commit; links are deleted only after it returns.
"""

from __future__ import annotations

import enum
import os
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lmdb
import msgspec

from cdcd import failpoints, formats
from cdcd.faults import ExitCode, Fault
from cdcd.wal.pointer import WalPointer, WalPosition
from cdcd.wal.records import CacheInfo

__all__ = [
    "RESET_HINT",
    "STATE_MAP_SIZE_BYTES",
    "DaemonState",
    "ForeignState",
    "CdcMode",
    "StateDamaged",
    "StateRefused",
    "StateStore",
    "check_lmdb_file",
    "read_daemon_state",
]


class CdcMode(enum.Enum):
    """Who delivers, named as Ignite's ``CdcMode``; the daemon persists it with its position.

    The values are the state's on-disk encoding (and the ``mode`` of status and ``state show``):
    IEP-104's names for the daemon's side, ACTIVE and PASSIVE."""

    DAEMON_ACTIVE = "ACTIVE"
    """The daemon delivers (the node's realtime worker is off, or still waits in a try-start)."""
    NODE_ACTIVE = "PASSIVE"
    """The node's realtime worker delivers; the daemon follows its markers and deletes links."""


DELIVERED_BY = ("realtime", "daemon")
"""Who delivers a consumer, as status and ``state show`` spell it (``delivered_by``): the node's realtime
worker, or the daemon from the archive. It replaces the older spellings of one reply (``cdc_mode``,
``delivering``, ``realtime.mode``, ACTIVE/PASSIVE), which stay one release, deprecated."""


def delivered_by(mode: CdcMode) -> str:
    """``realtime`` while the node's realtime worker delivers (PASSIVE), else ``daemon``."""
    return "realtime" if mode is CdcMode.NODE_ACTIVE else "daemon"


class DaemonState(msgspec.Struct, frozen=True):
    """``position``: every entry before it is committed (None: nothing yet, start at the oldest link)."""

    mode: CdcMode
    position: WalPosition | None = None
    updated_ns: int = 0
    commits: int = 0
    node_id: str = ""
    """The node this state belongs to ("" until the daemon learnt it); a state of another node is refused."""
    last_delivered: WalPointer | None = None
    """The last data record a consumer took, as of ``position`` (None: none yet, or a state written
    before this field): unlike the position, never moved by markers or cache records, so a consumer
    whose target says how far it holds (the lake's mark) can be compared with it exactly."""
    consumer: str = ""
    """The identity (kind and target) of the consumer this position belongs to ("" in a state written
    before consumers had names: bound to the consumer that next starts on it); another is refused."""


_enc = msgspec.msgpack.Encoder()
_state_dec = msgspec.msgpack.Decoder(DaemonState)
_cache_dec = msgspec.msgpack.Decoder(CacheInfo)

STATE_MAP_SIZE_BYTES = 256 << 20
FORMAT_KEY = b"format"
"""The state database's key of the format version (``cdcd.formats.DAEMON_STATE``; absent: 1, as v0.1.0 wrote)."""
RESET_HINT = "stop the daemon and run `cdcd state reset` (docs/daemon.md: Operator commands)"

# LMDB's two meta pages (lmdb.h/mdb.c, format version 1): page header (16 bytes), then
# mm_magic, mm_version, ..., the free DB's md_pad (the page size), ..., mm_last_pg, mm_txnid.
_LMDB_MAGIC = 0xBEEFC0DE
_META_MAGIC = struct.Struct("<II")
_META_PSIZE = struct.Struct("<I")
_META_TAIL = struct.Struct("<QQ")
_META_END = 152
# Errors that mean the file's content is bad, not that opening it failed for another reason.
_DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError)


class StateRefused(Fault, Exception):
    """The daemon's state cannot be used as it is: ``cdcd state reset`` is the way on (exit 7)."""

    exit_code = ExitCode.BAD_STATE


class StateDamaged(StateRefused, lmdb.Error):
    """The daemon's LMDB state is unreadable; the message names the file and says how to recover."""


class ForeignState(StateRefused):
    """The daemon's state belongs to another node than the one in ``node_dir``."""


def check_lmdb_file(data_file: Path) -> None:
    """Refuse an LMDB data file shorter than its meta pages say, before anything maps it: reading a
    mapped page past the end of a truncated file is SIGBUS, which kills the process without a word.
    A missing or empty file passes (LMDB creates a new environment there)."""
    try:
        with open(data_file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return
            head = f.read(_META_END)
            if len(head) < _META_END or _META_MAGIC.unpack_from(head, 16)[0] != _LMDB_MAGIC:
                raise StateDamaged(f"{data_file}: not an LMDB file ({size} bytes)")
            psize = _META_PSIZE.unpack_from(head, 40)[0]
            if psize < 512 or psize & (psize - 1) or size < 2 * psize:
                raise StateDamaged(f"{data_file}: truncated to {size} bytes, shorter than its two meta pages")
            f.seek(psize)
            second = f.read(_META_END)
    except FileNotFoundError:
        return
    metas = [m for m in (head, second) if len(m) == _META_END and _META_MAGIC.unpack_from(m, 16)[0] == _LMDB_MAGIC]
    last_pg, _txnid = max((_META_TAIL.unpack_from(m, 136) for m in metas), key=lambda t: t[1])
    needed = (last_pg + 1) * psize
    if size < needed:
        raise StateDamaged(f"{data_file}: truncated to {size} bytes, its last page ends at {needed}")


class StateStore:
    """Errors reading the state are ``StateDamaged`` naming ``data.mdb`` (one line, with the remedy)."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.data_file = path / "data.mdb"
        if not readonly:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        elif not self.data_file.exists() or self.data_file.stat().st_size == 0:
            raise FileNotFoundError(f"no daemon state in {path}")
        try:
            check_lmdb_file(self.data_file)
        except StateDamaged as exc:
            raise StateDamaged(f"{exc}: damaged daemon state; {RESET_HINT}") from None
        try:
            self.env = lmdb.open(str(path), map_size=STATE_MAP_SIZE_BYTES, max_dbs=2, mode=0o600, readonly=readonly)
        except _DAMAGE as exc:
            raise self._damaged(exc) from None
        try:
            self._state_db = self.env.open_db(b"state", create=not readonly)
            self._caches_db = self.env.open_db(b"caches", create=not readonly)
        except lmdb.NotFoundError:  # a daemon is creating its state right now
            self.env.close()
            raise FileNotFoundError(f"no daemon state in {path} yet") from None
        except (*_DAMAGE, lmdb.IncompatibleError) as exc:
            self.env.close()
            raise self._damaged(exc) from None
        try:
            self.format = self._check_format(readonly=readonly)
        except BaseException:
            self.env.close()
            raise

    def _check_format(self, *, readonly: bool) -> int:
        """The state's format version, refused when newer than this code's; an unmarked state (v0.1.0's, or
        a new one) is marked in one synced transaction, so a crash leaves it unmarked or marked, never half."""
        try:
            with self.env.begin(db=self._state_db) as txn:
                raw = txn.get(FORMAT_KEY)
        except _DAMAGE as exc:
            raise self._damaged(exc) from None
        try:
            found = None if raw is None else formats.parse_version(raw)
        except ValueError as exc:
            raise self._damaged(exc) from None
        version = formats.check(formats.DAEMON_STATE, found, str(self.data_file))
        if raw is None and not readonly:
            with self.env.begin(write=True, db=self._state_db) as txn:
                txn.put(FORMAT_KEY, str(formats.DAEMON_STATE.current).encode())
                failpoints.hit("formats.daemon_state.marking")
            version = formats.DAEMON_STATE.current
        return version

    def _damaged(self, exc: BaseException) -> StateDamaged:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return StateDamaged(f"{self.data_file}: damaged daemon state ({what}); {RESET_HINT}")

    def close(self) -> None:
        self.env.close()

    def load(self, initial_mode: CdcMode) -> DaemonState:
        try:
            with self.env.begin(db=self._state_db) as txn:
                raw = txn.get(b"state")
            return _state_dec.decode(raw) if raw is not None else DaemonState(initial_mode)
        except (*_DAMAGE, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._damaged(exc) from None

    def has_state(self) -> bool:
        """False for a new (or emptied) state: nothing was ever committed."""
        try:
            with self.env.begin(db=self._state_db) as txn:
                return txn.get(b"state") is not None
        except _DAMAGE as exc:
            raise self._damaged(exc) from None

    def caches(self) -> dict[int, CacheInfo]:
        try:
            with self.env.begin(db=self._caches_db) as txn:
                return {info.cache_id: info for info in (_cache_dec.decode(v) for _k, v in txn.cursor())}
        except (*_DAMAGE, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._damaged(exc) from None

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


def read_daemon_state(state_dir: Path) -> dict[str, Any] | None:
    """The daemon's committed mode and position, read-only (None when it has no state yet)."""
    try:
        store = StateStore(state_dir, readonly=True)
    except (FileNotFoundError, lmdb.Error):
        return None
    except formats.FormatTooNew as exc:  # the node's status says so rather than failing as a whole
        return {
            "mode": None,
            "cdc_mode": None,
            "position": None,
            "position_parts": None,
            "updated_ns": 0,
            "error": str(exc),
        }
    try:
        state = store.load(CdcMode.NODE_ACTIVE)
    finally:
        store.close()
    return {
        "mode": state.mode.value,
        "cdc_mode": state.mode.name,
        "position": str(state.position) if state.position else None,
        "position_parts": msgspec.to_builtins(state.position) if state.position else None,
        "updated_ns": state.updated_ns,
    }
