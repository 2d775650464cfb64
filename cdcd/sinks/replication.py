"""``kind = "replication"``: apply every change to another cluster's node through its endpoint.

Entries go in per-cache Apply requests in WAL order; a request is closed early when a key comes
again (as Ignite's applier does), so one request never holds two changes of one key. The batch is
confirmed only when the target has made every request durable. A lost connection is retried with
exponential backoff by the delivery loop (``RetriableError``), re-sending the whole batch: the
target's resolver recognises the changes it already applied (same origin version) and counts them
as duplicates. After ``retry_timeout_s`` without success the daemon exits (code 4) and its service
manager restarts it; a target that refuses us (``TargetRefused``) fails at once. An entry too large
for the target's frame limit (told in its welcome) is a ``RefusedEvent``: never sent, it fails the
daemon naming its position, or becomes a dead letter (``dead_letters = "on"``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import structlog

from cdcd import metrics
from cdcd.config import check_ranges, convert
from cdcd.consumer import CacheDrop, Consumer, EventBatch, RefusedEvent, RetriableError
from cdcd.replication.client import TargetRefused
from cdcd.replication.protocol import Applied, ProtocolError, ReplEntry
from cdcd.replication.target import TargetOptions
from cdcd.wal.pointer import EventAddress

log = structlog.get_logger("cdcd.sinks.replication")

MiB = 1 << 20
FRAME_OVERHEAD_BYTES = 256
"""What a one-entry Apply frame holds besides the entry's key, value and cache name (an upper bound)."""


class ReplicationOptions(TargetOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The target's keys (cdcd/replication/target.py) and the sink's own."""

    only_primary: bool = True
    """Send only changes of primary copies (backups are the same changes again)."""
    max_batch_size: int = 1024
    """Entries per apply request."""
    max_batch_bytes: int = 4 * MiB
    max_in_flight: int = 4
    """Requests sent before waiting for the oldest reply."""
    connect_timeout_ms: int = 5000
    request_timeout_ms: int = 30_000

    def __post_init__(self) -> None:
        checks = {
            "max_batch_size": self.max_batch_size >= 1,
            "max_batch_bytes": self.max_batch_bytes >= 1024,
            "max_in_flight": self.max_in_flight >= 1,
            "connect_timeout_ms": self.connect_timeout_ms >= 1,
            "request_timeout_ms": self.request_timeout_ms >= 1,
        }
        check_ranges(self, checks)


class ReplicationConsumer(Consumer):
    def __init__(self, options: ReplicationOptions, source: str) -> None:
        self.options = options
        target = options.open(source)
        self.client = target.client(
            connect_timeout_s=options.connect_timeout_ms / 1000,
            request_timeout_s=options.request_timeout_ms / 1000,
            max_in_flight=options.max_in_flight,
        )
        self._alive = True
        self._interrupted = threading.Event()
        self.sent = self.applied = self.rejected = self.duplicates = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any], source: str) -> ReplicationConsumer:
        return cls(convert(options, ReplicationOptions, source), source)

    def start(self, registry: Any = None) -> None:
        metrics.export(metrics.REPLICATION_SENDER)

    def alive(self) -> bool:
        return self._alive

    def stop(self) -> None:
        self.client.close()

    def interrupt(self) -> None:
        """Stop waiting for a failing target: the batch stays unconfirmed and the next run sends it."""
        self._interrupted.set()

    def _requests(self, batch: EventBatch, skipped: dict[str, int]) -> Iterator[tuple[str, list[ReplEntry]]]:
        """Per-cache requests in WAL order per cache; a repeated key or a full request closes one."""
        max_entries = self.options.max_batch_size
        welcome = self.client.welcome
        frame_limit = welcome.max_frame_bytes if welcome is not None and welcome.max_frame_bytes else 0
        max_bytes = self.options.max_batch_bytes
        if frame_limit:  # half of it: the per-entry estimate stays well inside the target's frame
            max_bytes = min(max_bytes, frame_limit // 2)
        only_primary = self.options.only_primary
        pending: dict[int, tuple[list[ReplEntry], set[bytes], list[int]]] = {}
        for s in batch.slices:
            entries = s.record.entries
            for i in range(s.start, len(entries) if s.stop is None else s.stop):
                e = entries[i]
                if e.version.other_cluster_version is not None:
                    skipped["replicated"] += 1  # came from another cluster: sending it back would loop
                    continue
                if only_primary and not e.primary:
                    skipped["backup"] += 1
                    continue
                slot = pending.get(e.cache_id)
                if slot is None:
                    slot = pending[e.cache_id] = ([], set(), [0])
                out, keys, size = slot
                key = bytes(e.key)
                entry_bytes = len(key) + len(e.value) + 48
                if frame_limit:
                    # only an entry over half the frame (max_bytes) can be over all of it: the name is looked up then
                    one_frame = len(key) + len(e.value) + FRAME_OVERHEAD_BYTES
                    if entry_bytes > max_bytes and one_frame + len(batch.cache_name(e.cache_id)) > frame_limit:
                        raise RefusedEvent(
                            EventAddress(s.pointer.segment, s.pointer.offset, i),
                            f"an entry of {len(key) + len(e.value)} bytes (key and value) does not fit the "
                            f"frame limit of replication target {self.client.target} ({frame_limit} bytes, its "
                            "replication_max_frame_bytes)",
                        )
                    if out and size[0] + entry_bytes > max_bytes:  # alone it fits; with the others it might not
                        yield batch.cache_name(e.cache_id), out
                        out, keys, size = slot = pending[e.cache_id] = ([], set(), [0])
                if key in keys:
                    yield batch.cache_name(e.cache_id), out
                    out, keys, size = slot = pending[e.cache_id] = ([], set(), [0])
                out.append(ReplEntry(e.op, e.key, e.value, e.version, e.expire_time_ms))
                keys.add(key)
                size[0] += entry_bytes
                if len(out) >= max_entries or size[0] >= max_bytes:
                    yield batch.cache_name(e.cache_id), out
                    del pending[e.cache_id]
        for cache_id, (out, _keys, _size) in pending.items():
            if out:
                yield batch.cache_name(cache_id), out

    def on_cache_drop(self, drops: Sequence[CacheDrop]) -> None:
        """The target destroys the cache too, and from now on rejects its entries older than the drop
        (cdcd/replication/drops.py): sent after every earlier batch was confirmed, once per drop (a
        resend after a crash is a duplicate there)."""
        for d in drops:
            try:
                if not self.client.connected:
                    self.client.sender_node = d.source_node
                    self.client.sender_cluster_id = d.version.cluster_id if d.version is not None else 0
                    self.client.connect()
                result = self.client.drop(d.name, d.version)
            except (OSError, ProtocolError) as exc:
                # The delivery loop offers the drop again, as it does a batch (the client reconnects;
                # the target counts a drop it had as a duplicate).
                metrics.REPL_RETRIES.inc()
                raise RetriableError(
                    f"replication target {self.client.target}: dropping cache {d.name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            log.info("replication_cache_dropped", cache=d.name, duplicate=bool(result.duplicates))

    def on_events(self, batch: EventBatch) -> bool:
        if not len(batch):
            return True
        if self._interrupted.is_set():
            return False  # stopping: confirm nothing more
        skipped: dict[str, int] = {}

        def attempt() -> Applied:
            skipped.update(replicated=0, backup=0)  # counted again by each attempt
            if not self.client.connected:
                first = batch.slices[0]
                self.client.sender_node = batch.source_node
                self.client.sender_cluster_id = first.record.entries[first.start].version.cluster_id
                welcome = self.client.connect()
                log.info("replication_connected", target=self.client.target, target_cluster=welcome.cluster_id)
            return self.client.apply_all(self._requests(batch, skipped))

        try:
            result = attempt()
        except TargetRefused:
            self._alive = False
            raise
        except (OSError, ProtocolError) as exc:  # ConnectionError, TimeoutError and ssl.SSLError are OSErrors
            # The client closed the connection: the delivery loop offers the batch again, the next
            # attempt reconnects and re-sends it whole (the target counts what it had as duplicates).
            metrics.REPL_RETRIES.inc()
            raise RetriableError(f"replication target {self.client.target}: {type(exc).__name__}: {exc}") from exc
        sent = result.applied + result.rejected + result.duplicates
        self.sent += sent
        self.applied += result.applied
        self.rejected += result.rejected
        self.duplicates += result.duplicates
        metrics.REPL_SENT_EVENTS.inc(sent)
        metrics.REPL_CONFLICTS.inc(result.rejected)
        for reason, n in skipped.items():
            if n:
                metrics.REPL_SKIPPED_EVENTS.labels(reason).inc(n)
        metrics.REPL_LAST_BATCH.set(time.time())
        return True
