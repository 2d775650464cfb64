"""The node's page store and metastorage in LMDB.

LMDB only ever holds the state as of the last checkpoint: everything newer lives in the node's
dirty map and in the WAL, so a crash at any moment leaves a consistent store plus a WAL to replay.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import uuid
from collections.abc import Iterable, Iterator, Mapping
from itertools import compress
from operator import attrgetter
from pathlib import Path

import lmdb
import msgspec

from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import CacheInfo, CacheVersion, DataEntry, Op

_CACHE_PREFIX = struct.Struct(">I")
_NEARLY_FULL_BYTES = 16 * 1024 * 1024
"""LMDB reports a failed page write as EIO: with less free space than this, call it a full disk."""


def cache_prefix(cache_id: int) -> bytes:
    return _CACHE_PREFIX.pack(cache_id)


_LMDB_MAX_KEY_BYTES = 511
"""LMDB's compiled-in key limit (``Environment.max_key_size()``)."""
_DIRECT_KEY_MAX_BYTES = _LMDB_MAX_KEY_BYTES - 8
"""Longest full key stored as it is: the expiry index puts an 8-byte expire time before it."""
_HASHED = b"\xc1"
"""Marks a hashed key after the cache prefix: 0xc1 is the one byte MessagePack never uses, so no
key stored as it is (its MessagePack encoding follows the prefix) can begin like a hashed one."""


def db_key(full_key: bytes) -> bytes:
    """Where LMDB keeps ``full_key``: the key itself when it fits, else cache prefix + 0xc1 +
    SHA-256 of the key (the full key is then kept in the StoredValue beside the value)."""
    if len(full_key) <= _DIRECT_KEY_MAX_BYTES:
        return full_key
    return full_key[:4] + _HASHED + hashlib.sha256(full_key).digest()


def _is_hashed(key: bytes) -> bool:
    return key[4:5] == _HASHED


class StoredValue(msgspec.Struct, frozen=True, array_like=True):
    version: CacheVersion
    value: msgspec.Raw
    expire_time_ms: int = 0
    full_key: bytes = b""
    """Only for a key stored hashed (``db_key``): the full key, so a scan can give it back."""


class _ExpireView(msgspec.Struct, frozen=True, array_like=True):
    """A StoredValue's expire time without decoding its version or value."""

    version: msgspec.Raw
    value: msgspec.Raw
    expire_time_ms: int = 0
    full_key: bytes = b""


_EXPIRE = struct.Struct(">Q")
"""Expiry index keys: big-endian expire time, then the LMDB key (so a cursor walks them in time order)."""


class CheckpointMeta(msgspec.Struct, frozen=True, array_like=True):
    pointer: WalPointer
    next_order: int
    ts_ns: int = 0


_enc = msgspec.msgpack.Encoder()
_op_of = attrgetter("op")
_version_of = attrgetter("version")
_value_of = attrgetter("value")
_expire_of = attrgetter("expire_time_ms")
_stored_dec = msgspec.msgpack.Decoder(StoredValue)
_cache_dec = msgspec.msgpack.Decoder(CacheInfo)
_cp_dec = msgspec.msgpack.Decoder(CheckpointMeta)
_expire_dec = msgspec.msgpack.Decoder(_ExpireView)


class PageStore:
    """LMDB environment with ``data`` (cache prefix + key -> StoredValue), ``caches``, ``meta`` and
    ``expiry`` (expire time + full key -> b"": every stored entry with an expire time, in time
    order; Ignite's pending-entries tree), kept with ``data`` in every checkpoint transaction."""

    def __init__(self, path: Path, map_size_bytes: int) -> None:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self.env = lmdb.open(str(path), map_size=map_size_bytes, max_dbs=4, mode=0o600, sync=True, metasync=True)
        self._data = self.env.open_db(b"data")
        self._caches = self.env.open_db(b"caches")
        self._meta = self.env.open_db(b"meta")
        self._expiry = self.env.open_db(b"expiry")

        self._reader: lmdb.Transaction | None = None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.abort()
            self._reader = None
        self.env.close()

    # --- meta ------------------------------------------------------------------------------------
    def node_id(self) -> uuid.UUID:
        """This node's id, created on first open."""
        with self.env.begin(db=self._meta, write=True) as txn:
            raw = txn.get(b"node_id")
            if raw is None:
                raw = uuid.uuid4().bytes
                txn.put(b"node_id", raw)
        return uuid.UUID(bytes=bytes(raw))

    def checkpoint(self) -> CheckpointMeta | None:
        with self.env.begin(db=self._meta) as txn:
            raw = txn.get(b"checkpoint")
        return _cp_dec.decode(raw) if raw is not None else None

    def meta_get(self, key: bytes) -> bytes | None:
        with self.env.begin(db=self._meta) as txn:
            raw = txn.get(key)
        return bytes(raw) if raw is not None else None

    def meta_put(self, key: bytes, value: bytes) -> None:
        with self.env.begin(db=self._meta, write=True) as txn:
            txn.put(key, value)

    # --- data ------------------------------------------------------------------------------------
    def get(self, full_key: bytes) -> StoredValue | None:
        with self.env.begin(db=self._data, buffers=True) as txn:
            raw = txn.get(db_key(full_key))
            return _stored_dec.decode(raw) if raw is not None else None

    def get_locked(self, full_key: bytes) -> StoredValue | None:
        """Like ``get`` through the long-lived read txn of ``exists_locked`` (same rules; the value is
        a view into LMDB's pages: copy it before ``renew_reader``)."""
        reader = self._reader
        if reader is None:
            reader = self._reader = self.env.begin(db=self._data, buffers=True)
        raw = reader.get(db_key(full_key))
        return _stored_dec.decode(raw) if raw is not None else None

    def exists(self, full_key: bytes) -> bool:
        with self.env.begin(db=self._data, buffers=True) as txn:
            return txn.get(db_key(full_key)) is not None

    def exists_locked(self, full_key: bytes) -> bool:
        """Like ``exists`` through one long-lived read txn; the caller serialises calls and
        ``renew_reader`` after every write, so the txn never shows a stale state."""
        reader = self._reader
        if reader is None:
            reader = self._reader = self.env.begin(db=self._data, buffers=True)
        return reader.get(db_key(full_key)) is not None

    def live_locked(self, full_key: bytes, now_ms: int) -> bool:
        """Like ``exists_locked``, but an expired entry (still stored until its DELETE) is not live."""
        reader = self._reader
        if reader is None:
            reader = self._reader = self.env.begin(db=self._data, buffers=True)
        raw = reader.get(db_key(full_key))
        if raw is None:
            return False
        expire = _expire_dec.decode(raw).expire_time_ms
        return not 0 < expire <= now_ms

    def expired(self, now_ms: int, limit: int, after: bytes | None = None) -> list[tuple[int, bytes, bytes]]:
        """Up to ``limit`` (expire time, full key, index key) of stored entries expired at
        ``now_ms``, oldest first, starting after the index key ``after`` (pass the last one's)."""
        out: list[tuple[int, bytes, bytes]] = []
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._expiry)
            found = cur.set_range(after) if after is not None else cur.first()
            if found and after is not None and cur.key() == after:
                found = cur.next()
            while found and len(out) < limit:
                k = cur.key()
                (expire,) = _EXPIRE.unpack_from(k)
                if expire > now_ms:
                    break
                key = bytes(k[_EXPIRE.size :])
                full_key = key
                if _is_hashed(key):
                    raw = txn.get(key, db=self._data)
                    full_key = _expire_dec.decode(raw).full_key if raw is not None else b""
                if full_key:
                    out.append((expire, full_key, bytes(k)))
                found = cur.next()
        return out

    def expiry_rows(self) -> int:
        """Rows of the expiry index (entries with an expire time, as of the last checkpoint)."""
        with self.env.begin() as txn:
            return int(txn.stat(self._expiry)["entries"])

    def renew_reader(self) -> None:
        if self._reader is not None:
            self._reader.abort()
            self._reader = None

    def items(self, cache_id: int) -> Iterator[tuple[bytes, StoredValue]]:
        """All stored (key raw, value) of one cache, in key-byte order."""
        prefix = cache_prefix(cache_id)
        with self.env.begin(db=self._data) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                stored = _stored_dec.decode(v)
                yield (stored.full_key if _is_hashed(k) else k)[len(prefix) :], stored

    def caches(self) -> dict[str, CacheInfo]:
        with self.env.begin(db=self._caches) as txn:
            return {bytes(k).decode(): _cache_dec.decode(v) for k, v in txn.cursor()}

    # --- writes ----------------------------------------------------------------------------------
    def write_checkpoint(
        self,
        entries: Mapping[bytes, DataEntry],
        caches: Mapping[str, CacheInfo],
        meta: CheckpointMeta,
        purge_cache_ids: Iterable[int] = (),
    ) -> None:
        """Apply a dirty-map snapshot, the cache registry and the checkpoint pointer in one synced txn."""
        try:
            self._write_checkpoint(entries, caches, meta, purge_cache_ids)
        except lmdb.Error as exc:
            raise self._disk_error(exc) from exc

    def _disk_error(self, exc: lmdb.Error) -> Exception:
        """``exc`` naming the database file, and the full disk when that is the likely cause."""
        where = self.path / "data.mdb"
        try:
            st = os.statvfs(self.path)
        except OSError:
            return OSError(errno.EIO, f"{where}: {exc}")
        free = st.f_bavail * st.f_frsize
        if free < _NEARLY_FULL_BYTES:
            return OSError(errno.ENOSPC, f"{where}: disk full ({free} bytes free): {exc}")
        return OSError(errno.EIO, f"{where}: {exc}")

    def _write_checkpoint(
        self,
        entries: Mapping[bytes, DataEntry],
        caches: Mapping[str, CacheInfo],
        meta: CheckpointMeta,
        purge_cache_ids: Iterable[int],
    ) -> None:
        with self.env.begin(write=True) as txn:
            for cid in purge_cache_ids:
                self._purge(txn, cid)
            # The expiry index costs a read of each replaced value: only once any entry has an expire time.
            if txn.stat(self._expiry)["entries"] or any(map(_expire_of, entries.values())):
                self._write_tracking_expiry(txn, entries)
            else:
                self._write_plain(txn, entries)
            cur = txn.cursor(db=self._caches)
            existing = {bytes(k).decode() for k in cur.iternext(keys=True, values=False)}
            for name in existing - set(caches):
                txn.delete(name.encode(), db=self._caches)
            for name, info in caches.items():
                txn.put(name.encode(), _enc.encode(info), db=self._caches)
            txn.put(b"checkpoint", _enc.encode(meta), db=self._meta)

    def _write_plain(self, txn: lmdb.Transaction, entries: Mapping[bytes, DataEntry]) -> None:
        """Entries without expire times. One C-level pipeline (attribute getters, StoredValue,
        encode, ``putmulti``) instead of a Python loop: the checkpoint holds the GIL the writers need."""
        data = self._data
        delete = Op.DELETE
        if entries and max(map(len, entries)) > _DIRECT_KEY_MAX_BYTES:
            self._write_tracking_expiry(txn, entries)
            return
        keys: Iterable[bytes] = entries.keys()
        values: Iterable[DataEntry] = entries.values()
        ops = list(map(_op_of, values))
        if delete in ops:
            for key in compress(keys, map(delete.__eq__, ops)):
                txn.delete(key, db=data)
            kept = list(map(delete.__ne__, ops))
            keys, values = compress(keys, kept), list(compress(values, kept))
        stored = map(StoredValue, map(_version_of, values), map(_value_of, values), map(_expire_of, values))
        txn.cursor(db=data).putmulti(zip(keys, map(_enc.encode, stored), strict=True))

    def _write_tracking_expiry(self, txn: lmdb.Transaction, entries: Mapping[bytes, DataEntry]) -> None:
        """One entry at a time, keeping the expiry index; also the path for any hashed key."""
        data, expiry = self._data, self._expiry
        delete = Op.DELETE
        pack = _EXPIRE.pack
        for full_key, e in entries.items():
            key = db_key(full_key)
            if e.op == delete:
                old = txn.pop(key, db=data)
            else:
                kept = full_key if key is not full_key else b""
                old = txn.replace(key, _enc.encode(StoredValue(e.version, e.value, e.expire_time_ms, kept)), db=data)
            if old is not None:
                old_expire = _expire_dec.decode(old).expire_time_ms
                if old_expire:
                    txn.delete(pack(old_expire) + key, db=expiry)
            if e.op != delete and e.expire_time_ms:
                txn.put(pack(e.expire_time_ms) + key, b"", db=expiry)

    def purge_cache(self, cache_id: int, name: str) -> None:
        """Delete every stored entry of a destroyed cache and its registry row, synced."""
        with self.env.begin(write=True) as txn:
            self._purge(txn, cache_id)
            txn.delete(name.encode(), db=self._caches)

    def _purge(self, txn: lmdb.Transaction, cache_id: int) -> None:
        prefix = cache_prefix(cache_id)
        cur = txn.cursor(db=self._data)
        if cur.set_range(prefix):
            while bytes(cur.key()).startswith(prefix):
                if not cur.delete():
                    break
        # Expiry rows are in time order: the cache's rows are found by a walk over all of them.
        at = _EXPIRE.size
        cur = txn.cursor(db=self._expiry)
        found = cur.first()
        while found:
            k = bytes(cur.key())
            if not k:  # past the last row (after deleting it)
                break
            found = cur.delete() if k[at : at + len(prefix)] == prefix else cur.next()
