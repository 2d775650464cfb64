"""The conflict resolver of a receiving node (Ignite's ``CacheVersionConflictResolver`` rules).

A replicated entry meets the entry the receiver holds for its key; the rules, in order:

1. the new entry comes from the local cluster (and the held one does not): the new one wins;
2. nothing is held for the key: the new one wins;
3. both come from the same origin cluster: the higher origin version wins (tie: the later
   expire time; a full tie is the same change delivered twice, a *duplicate*);
4. ``conflict_resolve_field`` is set and both values are maps holding comparable values under
   it: the higher wins; equal fields go to the higher origin cluster id, so both sides of an
   active-active pair pick the same winner;
5. otherwise the new entry is rejected, logged with both versions and counted.

"Origin version" is the version an entry got in the cluster where it was written: the
``other_cluster_version`` of a replicated entry, the entry's own version otherwise. Versions
compare as Ignite's ``GridCacheVersion.compareTo`` does (topology version, order, node order).

Log lines name a key by ``key_hash`` (never the key or a value), unless ``log_keys`` is on.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import structlog

from cdcd.config import ConfigError, import_object
from cdcd.node.writes import key_hash
from cdcd.replication.protocol import ReplEntry
from cdcd.wal.records import CacheVersion

log = structlog.get_logger("cdcd.replication")

_decoder = msgspec.msgpack.Decoder()


class Rule(enum.IntEnum):
    LOCAL = 1
    NEW = 2
    VERSION = 3
    FIELD = 4
    UNRESOLVED = 5


class Verdict(msgspec.Struct, frozen=True):
    use_new: bool
    rule: Rule
    duplicate: bool = False


class Held(msgspec.Struct, frozen=True):
    """What the receiver holds for a key: its value, origin version and expire time."""

    value: bytes
    version: CacheVersion
    expire_time_ms: int = 0


_NEW = Verdict(True, Rule.NEW)
_LOCAL = Verdict(True, Rule.LOCAL)
_NEWER = Verdict(True, Rule.VERSION)
_OLDER = Verdict(False, Rule.VERSION)
_DUPLICATE = Verdict(False, Rule.VERSION, duplicate=True)
"""The common verdicts, shared: one is returned per replicated entry (verdicts are frozen)."""


def origin_version(version: CacheVersion) -> CacheVersion:
    return version.other_cluster_version or version


def _field(raw: bytes, name: str) -> Any:
    try:
        value = _decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    return value.get(name) if isinstance(value, dict) else None


def _comparable(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    return (isinstance(a, numbers) and isinstance(b, numbers)) or (isinstance(a, str) and isinstance(b, str))


class ConflictResolver:
    """The default rules; subclass and override ``resolve`` (or ``unresolved``) for your own.

    Called under the node's write lock, once per replicated entry, in the origin's order: keep it fast.
    """

    log_keys: bool = False
    """Log lines carry the key in clear (``log_keys = true`` in the node's config), not its hash."""

    def __init__(self, cluster_id: int, conflict_resolve_field: str = "", *, log_keys: bool = False) -> None:
        self.cluster_id = cluster_id
        self.conflict_resolve_field = conflict_resolve_field
        self.log_keys = log_keys

    def resolve(self, cache: str, key: bytes, held: Held | None, new: ReplEntry) -> Verdict:
        new_v = new.version
        if held is None:
            return _NEW if new_v.cluster_id != self.cluster_id else _LOCAL
        old_v = held.version
        if new_v.cluster_id == self.cluster_id and old_v.cluster_id != self.cluster_id:
            return _LOCAL
        if new_v.cluster_id == old_v.cluster_id:
            if new_v != old_v:
                if new_v > old_v:
                    return _NEWER
                if new_v.node_order == old_v.node_order and new_v.topology_version != old_v.topology_version:
                    self._older_open(cache, key, held, new)
                return _OLDER
            if new.expire_time_ms != held.expire_time_ms:
                return _NEWER if new.expire_time_ms > held.expire_time_ms else _OLDER
            return _DUPLICATE
        field = self.conflict_resolve_field
        if field:
            new_f = _field(bytes(new.value), field)
            old_f = _field(held.value, field)
            if new_f is not None and old_f is not None and _comparable(new_f, old_f):
                if new_f != old_f:
                    return Verdict(bool(new_f > old_f), Rule.FIELD)
                return Verdict(new_v.cluster_id > old_v.cluster_id, Rule.FIELD)
        return self.unresolved(cache, key, held, new)

    def _older_open(self, cache: str, key: bytes, held: Held, new: ReplEntry) -> None:
        """Rule 3 rejects a change of the same origin node made in an earlier open of it (a lower
        topology version). Normal versions never go back across opens, so this is either an older
        history sent again (a daemon restored with its node dir) or a change made later that lost:
        the node's clock stepped back before it was re-created or restored, or a fixed
        ``topology_version``. Said at warning level, as the counter alone hides the second case."""
        log.warning(
            "replication_older_open_rejected",
            cache=cache,
            **self._key_field(key),
            held_version=_version_text(held.version),
            new_version=_version_text(new.version),
            hint="a change from an earlier open of the origin node; if it was made later, the origin "
            "node's clock went back (see docs/replication.md, topology version)",
        )

    def _key_field(self, key: bytes) -> dict[str, str]:
        return {"key": _repr_key(key)} if self.log_keys else {"key_hash": key_hash(key)}

    def unresolved(self, cache: str, key: bytes, held: Held, new: ReplEntry) -> Verdict:
        """Rule 5: keep what is held, and say so."""
        log.warning(
            "replication_conflict_unresolved",
            cache=cache,
            **self._key_field(key),
            held_version=_version_text(held.version),
            new_version=_version_text(new.version),
            conflict_resolve_field=self.conflict_resolve_field or None,
        )
        return Verdict(False, Rule.UNRESOLVED)


def _repr_key(key: bytes) -> str:
    try:
        text = repr(_decoder.decode(key))
    except (msgspec.DecodeError, RecursionError):
        text = f"0x{key.hex()}"
    return text if len(text) <= 200 else text[:197] + "..."


def _version_text(v: CacheVersion) -> str:
    return f"cluster {v.cluster_id} node {v.node_order} order {v.order} topology {v.topology_version}"


def load_resolver(
    spec: str, cluster_id: int, conflict_resolve_field: str, source: str, *, log_keys: bool = False
) -> ConflictResolver:
    """The resolver named by ``spec`` (``package.module:Class``; "" for the default)."""
    if log_keys:
        log.warning(
            "log_keys_on",
            source=source,
            hint="the conflict resolver logs keys in clear (log_keys = true); turn it off unless debugging",
        )
    if not spec:
        return ConflictResolver(cluster_id, conflict_resolve_field, log_keys=log_keys)
    cls = import_object(spec, source, "replication_resolver")
    if not isinstance(cls, type) or not issubclass(cls, ConflictResolver):
        raise ConfigError(
            f"{source}: key 'replication_resolver': {spec} is not a subclass of "
            "cdcd.replication.resolver.ConflictResolver"
        )
    resolver = cls(cluster_id, conflict_resolve_field)
    resolver.log_keys = log_keys  # set after construction: subclasses keep the two-argument constructor
    return resolver
