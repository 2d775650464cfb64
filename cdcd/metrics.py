"""Every Prometheus metric of cdcd, declared in one place.

Metrics live in the process-wide default registry; a process runs one node and/or one daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cdcd.wal.records import Op


class NodeStats:
    """Plain counters the node bumps under its own lock; read at scrape time (no lock per put)."""

    def __init__(self) -> None:
        self.entries = {Op.CREATE: 0, Op.UPDATE: 0, Op.DELETE: 0}
        self.transactions = 0
        self.recovery_records = 0


class _NodeCollector(Collector):
    def __init__(self) -> None:
        self._nodes: list[NodeStats] = []
        self._lock = threading.Lock()

    def add(self, stats: NodeStats) -> None:
        with self._lock:
            self._nodes.append(stats)

    def remove(self, stats: NodeStats) -> None:
        with self._lock:
            self._nodes = [s for s in self._nodes if s is not stats]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        with self._lock:
            nodes = list(self._nodes)
        entries = CounterMetricFamily("cdcd_node_entries", "Entries committed to the WAL", labels=["op"])
        for op in Op:
            entries.add_metric([op.name.lower()], sum(n.entries[op] for n in nodes))
        yield entries
        yield CounterMetricFamily(
            "cdcd_node_transactions", "DataRecords committed", value=sum(n.transactions for n in nodes)
        )
        yield GaugeMetricFamily(
            "cdcd_node_recovery_records",
            "WAL records replayed at the last open",
            value=sum(n.recovery_records for n in nodes),
        )


_node_collector = _NodeCollector()
REGISTRY.register(_node_collector)


def register_node(stats: NodeStats) -> None:
    _node_collector.add(stats)


def unregister_node(stats: NodeStats) -> None:
    _node_collector.remove(stats)


# --- node: WAL -----------------------------------------------------------------------------------
WAL_BYTES = Counter("cdcd_node_wal_bytes_total", "Bytes written to WAL segments")
WAL_FSYNCS = Counter("cdcd_node_wal_fsyncs_total", "fdatasync calls on WAL segments")
WAL_FLUSH_SECONDS = Histogram(
    "cdcd_node_wal_flush_seconds",
    "Time to write and fsync one flush",
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
WAL_SEGMENT = Gauge("cdcd_node_wal_segment", "Index of the active WAL segment")
SEGMENTS_ARCHIVED = Counter("cdcd_node_segments_archived_total", "Segments moved to the archive")
CDC_LINKS = Counter("cdcd_node_cdc_links_total", "Archived segments hard-linked into the CDC dir")
CDC_LINKS_SKIPPED = Counter(
    "cdcd_node_cdc_links_skipped_total",
    "Archived segments NOT linked: the CDC dir was over cdc_dir_max_bytes, or CDC was switched off",
)
CDC_DISABLED = Gauge("cdcd_node_cdc_disabled", "1 while CDC links are switched off (cdcd control cdc off)")
TTL_EXPIRED = Counter("cdcd_node_ttl_expired_total", "Expired entries deleted by the expirer (DELETEs written)")
ARCHIVE_DELETED = Counter("cdcd_node_archive_segments_deleted_total", "Archived segments deleted by retention")
CHECKPOINTS = Counter("cdcd_node_checkpoints_total", "Checkpoints written to the page store")
CHECKPOINT_SECONDS = Histogram("cdcd_node_checkpoint_seconds", "Time to write one checkpoint to LMDB")

# --- daemon ---------------------------------------------------------------------------------------
DAEMON_EVENTS = Counter("cdcd_daemon_events_total", "Events confirmed by the consumer", ["cache", "op"])
DAEMON_BATCHES = Counter("cdcd_daemon_batches_total", "Batches handed to the consumer", ["result"])
DAEMON_BATCH_EVENTS = Histogram(
    "cdcd_daemon_batch_events",
    "Events per batch",
    buckets=(1, 10, 100, 1000, 10_000, 50_000, 100_000, 500_000),
)
DAEMON_CONSUMER_SECONDS = Histogram(
    "cdcd_daemon_consumer_call_seconds",
    "Time spent in one consumer on_events call",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
DAEMON_COMMIT_SECONDS = Histogram("cdcd_daemon_commit_seconds", "Time to persist the state (synced LMDB txn)")
DAEMON_COMMITTED_SEGMENT = Gauge("cdcd_daemon_committed_segment", "Segment of the committed position")
DAEMON_COMMITTED_OFFSET = Gauge("cdcd_daemon_committed_offset", "Offset of the committed position")
DAEMON_CURRENT_SEGMENT = Gauge("cdcd_daemon_current_segment", "Segment the reader is in")
DAEMON_SEGMENTS_PENDING = Gauge("cdcd_daemon_segments_pending", "Links in the CDC dir not yet fully consumed")
DAEMON_LAG_SECONDS = Gauge(
    "cdcd_daemon_lag_seconds", "now - commit time of the last delivered event (0 when the clock went back)"
)
DAEMON_LAST_COMMIT = Gauge("cdcd_daemon_last_commit_timestamp_seconds", "Wall time of the last state commit")
DAEMON_MODE = Gauge("cdcd_daemon_mode", "1 for the daemon's current mode", ["mode"])
DAEMON_MODE_SWITCHES = Counter("cdcd_daemon_mode_switches_total", "Mode switches", ["direction"])
DAEMON_LINKS_DELETED = Counter("cdcd_daemon_links_deleted_total", "Consumed segment links deleted")

# --- node: realtime CDC -------------------------------------------------------------------------------
RT_MODE = Gauge("cdcd_node_realtime_mode", "1 for the realtime worker's current mode", ["mode"])
RT_BUFFER_BYTES = Gauge("cdcd_node_realtime_buffer_bytes", "Flushed WAL bytes held by the realtime worker")
RT_BUFFER_MAX_USED_BYTES = Gauge("cdcd_node_realtime_buffer_max_used_bytes", "Highest buffer use since open")
RT_COMMITTED_SEGMENT = Gauge("cdcd_node_realtime_committed_segment", "Segment of the realtime committed position")
RT_COMMITTED_OFFSET = Gauge("cdcd_node_realtime_committed_offset", "Offset of the realtime committed position")
RT_LAG_SEGMENTS = Gauge("cdcd_node_realtime_lag_segments", "Active WAL segment - committed segment")
RT_LAG_MS = Histogram(
    "cdcd_node_realtime_lag_ms",
    "WAL commit to consumer confirmation, per batch (ms)",
    buckets=(0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000, 5000),
)
RT_RESTORED_RECORDS = Gauge("cdcd_node_realtime_restored_records", "WAL records re-read at the last restore")
RT_STOPS = Counter("cdcd_node_realtime_stops_total", "Realtime stops", ["reason"])
RT_EVENTS = Counter("cdcd_node_realtime_events_total", "Events confirmed by the realtime consumer")

# --- lake sink ------------------------------------------------------------------------------------
LAKE_ROWS = Counter("cdcd_lake_rows_written_total", "Change-log rows landed in the lake", ["cache"])
LAKE_WRITE_SECONDS = Histogram(
    "cdcd_lake_spark_write_seconds",
    "Time to write one batch's change files to staging (by Spark or pyarrow: the sink's writer option)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
LAKE_LAG_SECONDS = Gauge("cdcd_lake_lag_seconds", "now - commit time of the last landed event (never negative)")
LAKE_DUPLICATE_BATCHES = Counter(
    "cdcd_lake_batches_skipped_total", "Batches (or parts) dropped as replays at or below the high-water mark"
)
LAKE_CONFLICTS = Counter("cdcd_lake_log_conflicts_total", "Commits retried because another writer committed first")

# --- replication ------------------------------------------------------------------------------------
REPL_RECEIVED = Counter(
    "cdcd_replication_received_entries_total",
    "Replicated entries this node received, by the resolver rule that decided (or 'duplicate')",
    ["rule"],
)
REPL_REJECTED = Counter("cdcd_replication_rejected_entries_total", "Replicated entries the resolver rejected")
REPL_REFUSED = Counter(
    "cdcd_replication_refused_total", "Connections or requests the replication endpoint refused", ["reason"]
)
REPL_CONNECTIONS = Gauge("cdcd_replication_connections", "Open connections to the replication endpoint")
REPL_SENT_EVENTS = Counter("cdcd_replication_sent_events_total", "Events the replication consumer sent and had applied")
REPL_SKIPPED_EVENTS = Counter(
    "cdcd_replication_skipped_events_total",
    "Events not sent: replicated from elsewhere (no loops), backup copies, or caches not selected",
    ["reason"],
)
REPL_SENT_REQUESTS = Counter("cdcd_replication_sent_requests_total", "Apply requests answered by the target")
REPL_SENT_BYTES = Counter("cdcd_replication_sent_bytes_total", "Bytes of apply requests sent")
REPL_LAST_BATCH = Gauge("cdcd_replication_last_batch_timestamp_seconds", "Wall time of the last fully applied batch")
REPL_APPLY_SECONDS = Histogram(
    "cdcd_replication_apply_seconds",
    "Apply request sent to reply received (the target's resolver, WAL append and fsync included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
)
REPL_RETRIES = Counter("cdcd_replication_retries_total", "Reconnects after a failed connection or request")
REPL_CONFLICTS = Counter(
    "cdcd_replication_rejected_by_target_total", "Entries the target's resolver rejected (from its replies)"
)
