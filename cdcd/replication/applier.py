"""Applying another cluster's changes to a node (the receiving side of replication), and the
replication endpoint a node with ``replication_listen`` serves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from cdcd import metrics
from cdcd.config import split_host_port
from cdcd.node.writes import (
    MAX_EXPIRE_TIME_MS,
    MAX_KEY_BYTES,
    MAX_NESTING,
    CacheDestroyed,
    Change,
    Current,
    decoder,
    key_encoder,
    too_deep,
)
from cdcd.replication import credentials
from cdcd.replication.drops import DropMarks
from cdcd.replication.protocol import Applied, Apply, Drop, ReplEntry, Welcome
from cdcd.replication.resolver import ConflictResolver, Held, Rule, load_resolver, origin_version
from cdcd.replication.server import ReplicationServer, RequestRefused
from cdcd.wal.pointer import WalPointer
from cdcd.wal.records import NIL, CacheVersion, Op

if TYPE_CHECKING:
    from cdcd.node.node import Node

_DELETE = Op.DELETE
log = structlog.get_logger("cdcd.replication")


def replication_server(node: Node) -> ReplicationServer | None:
    """The endpoint ``replication_listen`` asks for (None: not configured)."""
    config = node.config
    if not config.replication_listen:
        return None
    source = f"node {config.node_dir}"
    resolver = load_resolver(
        config.replication_resolver, config.cluster_id, config.conflict_resolve_field, source, log_keys=config.log_keys
    )
    return ReplicationServer(
        split_host_port(config.replication_listen, min_port=0),  # checked by NodeConfig
        token=credentials.read_token(config.replication_token_file, "replication_token_file", source),
        apply=lambda request: stage_replicated(node, request, resolver),
        wait_durable=node.wal.wait_durable,
        welcome=Welcome(config.cluster_id, str(node.node_id), max_frame_bytes=config.replication_max_frame_bytes),
        tls=credentials.server_context(
            config.replication_tls_cert, config.replication_tls_key, config.replication_tls_ca, source
        ),
        max_frame_bytes=config.replication_max_frame_bytes,
        max_connections=config.replication_max_connections,
        auth_timeout_s=config.replication_auth_timeout_ms / 1000,
    )


def apply_replicated(node: Node, request: Apply, resolver: ConflictResolver) -> Applied:
    """Apply another cluster's changes through ``resolver``; durable when this returns.

    Accepted entries are written as one DataRecord with this node's versions, each keeping its
    origin version in ``other_cluster_version`` (so no daemon sends it back). Raises
    RequestRefused, and applies nothing, if any entry is malformed."""
    reply, end = stage_replicated(node, request, resolver)
    if end is not None:
        node.wal.wait_durable(end)  # whatever wal_mode: the sender commits its position on our reply
    return reply


def stage_replicated(
    node: Node, request: Apply | Drop, resolver: ConflictResolver
) -> tuple[Applied, WalPointer | None]:
    """``apply_replicated`` without the wait: the reply, and the WAL end that must be durable
    before it is sent (None: nothing was written)."""
    marks = DropMarks.of(node)
    if isinstance(request, Drop):
        return _drop(node, request, marks), None
    prepared = _prepare(request)
    before = len(prepared)
    prepared = [(k, e) for k, e in prepared if not marks.covers(request.cache, e.version)]
    dropped = before - len(prepared)
    if dropped:
        metrics.REPL_REJECTED.inc(dropped)
        log.info("replication_rejected_before_drop", cache=request.cache, entries=dropped)
    if not prepared:
        return Applied(request.seq, 0, dropped), None
    info = node.cache_info(request.cache)
    if info is None:
        try:
            info = node.cache(request.cache, partitions=request.partitions or None).info
        except ValueError as exc:
            raise RequestRefused(str(exc)) from None
    counts = dict.fromkeys(Rule, 0)
    applied = rejected = duplicates = 0
    name, resolve = info.name, resolver.resolve

    def decide(change: Change, current: Current | None) -> tuple[Op, CacheVersion | None] | None:
        nonlocal applied, rejected, duplicates
        new = entries[id(change)]
        held = None if current is None else Held(current.value, origin_version(current.version), current.expire_time_ms)
        verdict = resolve(name, change[1], held, new)
        if verdict.duplicate:
            duplicates += 1
            return None
        counts[verdict.rule] += 1
        if not verdict.use_new:
            rejected += 1
            return None
        applied += 1
        if new.op is _DELETE:
            return None if current is None else (_DELETE, new.version)
        return (Op.UPDATE if current is not None else Op.CREATE), new.version

    changes: list[Change] = [(info, key_raw, e.value, e.expire_time_ms, e.version) for key_raw, e in prepared]
    entries = {id(change): e for change, (_k, e) in zip(changes, prepared, strict=True)}
    try:
        _written, end = node.writes.write(changes, decide)
    except CacheDestroyed as exc:
        raise RequestRefused(f"{exc} while applying") from None
    for rule, n in counts.items():
        if n:
            metrics.REPL_RECEIVED.labels(rule.name.lower()).inc(n)
    if duplicates:
        metrics.REPL_RECEIVED.labels("duplicate").inc(duplicates)
    if rejected:
        metrics.REPL_REJECTED.inc(rejected)
    return Applied(request.seq, applied, rejected + dropped, duplicates), end


def _drop(node: Node, request: Drop, marks: DropMarks) -> Applied:
    """Destroy the cache as its origin did, once per drop (cdcd/replication/drops.py)."""
    version = request.version
    with marks.lock:
        if version is not None:
            held = marks.version(request.cache, version.cluster_id)
            if held is not None and version <= held:
                return Applied(request.seq, 0, 0, 1)  # this drop again: rows after it stay
        existed = node.destroy_cache(request.cache)
        if version is not None:
            marks.record(request.cache, version)  # after the destroy: a crash in between destroys again
    log.info("replication_cache_dropped", cache=request.cache, existed=existed)
    return Applied(request.seq, 1, 0)


def _prepare(request: Apply) -> list[tuple[bytes, ReplEntry]]:
    """(canonical key bytes, entry) of every entry, checked as a local write would be: a peer
    must not be able to put what this node's own readers cannot decode into its WAL. (Frame
    decoding already proved every key and value well-formed MessagePack.)"""
    out = []
    nil = bytes(NIL)
    for i, e in enumerate(request.entries):
        if not 1 <= e.version.cluster_id <= 31:
            raise RequestRefused(
                f"cache {request.cache!r} entry {i}: origin cluster id {e.version.cluster_id} is not in 1-31"
            )
        if not 0 <= e.expire_time_ms <= MAX_EXPIRE_TIME_MS:
            raise RequestRefused(f"cache {request.cache!r} entry {i}: expire_time_ms {e.expire_time_ms} out of range")
        value = bytes(e.value)
        if (value == nil) is not (e.op is _DELETE):
            what = "a delete carries a value" if e.op is _DELETE else "a put without a value"
            raise RequestRefused(f"cache {request.cache!r} entry {i}: {what}")
        try:
            key = decoder.decode(e.key)
            # Only long encodings can nest too deep (each level costs a byte): decode just those.
            if len(e.key) > MAX_NESTING and too_deep(key):
                raise ValueError(f"key nests deeper than {MAX_NESTING} levels")
            if len(value) > MAX_NESTING and too_deep(decoder.decode(value)):
                raise ValueError(f"value nests deeper than {MAX_NESTING} levels")
            key_raw = key_encoder.encode(key)  # canonical: equal keys, equal bytes, whoever encoded them
            if len(key_raw) > MAX_KEY_BYTES:
                raise ValueError(f"key is {len(key_raw)} bytes encoded, over the limit of {MAX_KEY_BYTES} bytes")
        except (msgspec.DecodeError, RecursionError, TypeError, ValueError) as exc:
            raise RequestRefused(f"cache {request.cache!r} entry {i}: {exc}") from None
        out.append((key_raw, e if e.version.other_cluster_version is None else _as_origin(e)))
    return out


def _as_origin(e: ReplEntry) -> ReplEntry:
    return ReplEntry(e.op, e.key, e.value, origin_version(e.version), e.expire_time_ms)
