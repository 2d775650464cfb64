"""Every Prometheus metric of cdcd, declared in one place.

Each family belongs to one group registry (node, daemon, lake, replication endpoint, replication
sender). A group joins the process-wide default registry, the one the metrics listener serves,
only when its part starts in this process (``export``): a node process shows no daemon series
and a daemon none of the node's. Declare new metrics with ``registry=`` one of the groups.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cdcd.logging import lines_lost
from cdcd.wal.records import Op

if TYPE_CHECKING:
    import numpy as np

NODE = CollectorRegistry(auto_describe=True)
"""The node: WAL, archive, checkpoints, realtime worker."""
DAEMON = CollectorRegistry(auto_describe=True)
LAKE = CollectorRegistry(auto_describe=True)
"""The lake sink, wherever it runs (daemon or the node's realtime worker)."""
REPLICATION_ENDPOINT = CollectorRegistry(auto_describe=True)
"""A node's replication endpoint (what it received and applied)."""
REPLICATION_SENDER = CollectorRegistry(auto_describe=True)
"""The replication consumer (what it sent), wherever it runs."""

_exported: set[int] = set()
_export_lock = threading.Lock()


def export(group: CollectorRegistry) -> None:
    """Serve ``group``'s families from this process's metrics listener (idempotent)."""
    with _export_lock:
        if id(group) not in _exported:
            REGISTRY.register(group)
            _exported.add(id(group))


class BulkHistogram(Collector):
    """A histogram fed a whole batch of observations at once (numpy), for per-event timings at a
    rate where one ``Histogram.observe`` per event would cost more than the delivery."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name = name
        self._documentation = documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: np.ndarray, weights: np.ndarray) -> None:
        """Observe ``values[i]`` ``weights[i]`` times each."""
        # Imported here: every node, writer and CLI process imports this module, only a daemon's capture path feeds
        # arrays, and numpy is a large part of a short process's start.
        import numpy as np

        bins = np.searchsorted(self._bounds, values, side="left")  # first bound >= value: Prometheus' "le"
        counts = np.bincount(bins, weights=weights, minlength=len(self._counts)).astype(np.int64).tolist()
        total = float(np.dot(values, weights))
        with self._lock:
            self._counts = [have + new for have, new in zip(self._counts, counts, strict=True)]
            self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative = list(itertools.accumulate(self._counts))
            total = self._sum
        bounds = [repr(b) for b in self._bounds] + ["+Inf"]
        yield HistogramMetricFamily(
            self.name, self._documentation, buckets=list(zip(bounds, cumulative, strict=True)), sum_value=total
        )


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
NODE.register(_node_collector)


class _LogLinesLost(Collector):
    """The process's lost log lines (``cdcd.logging``), under the name of the group it serves in."""

    def __init__(self, name: str, registry: CollectorRegistry) -> None:
        self._name = name
        registry.register(self)

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            self._name,
            "Log lines this process could not write (its log reader gone or not reading, a full disk, no stderr)",
            value=lines_lost(),
        )


_LogLinesLost("cdcd_node_log_lines_lost", NODE)
_LogLinesLost("cdcd_daemon_log_lines_lost", DAEMON)


def watch_consumer(name: str, state: Callable[[], str], retained_bytes: Callable[[], float], cap: int) -> None:
    """The named consumer's state and retained bytes, read at scrape time from ``state()`` (one of
    ``CONSUMER_STATES``) and ``retained_bytes()``: no code path has to remember to set them."""
    for each in CONSUMER_STATES:
        DAEMON_CONSUMER_STATE.labels(name, each).set_function(functools.partial(_is_state, state, each))
    DAEMON_CONSUMER_RETAINED_BYTES.labels(name).set_function(retained_bytes)
    DAEMON_CONSUMER_MAX_RETAINED_BYTES.labels(name).set(cap)


def _is_state(state: Callable[[], str], which: str) -> float:
    return 1.0 if state() == which else 0.0


def register_node(stats: NodeStats) -> None:
    export(NODE)
    _node_collector.add(stats)


def unregister_node(stats: NodeStats) -> None:
    _node_collector.remove(stats)


# --- node: WAL -----------------------------------------------------------------------------------
WAL_BYTES = Counter("cdcd_node_wal_bytes_total", "Bytes written to WAL segments", registry=NODE)
WAL_FSYNCS = Counter("cdcd_node_wal_fsyncs_total", "fdatasync calls on WAL segments", registry=NODE)
WAL_FLUSH_SECONDS = Histogram(
    "cdcd_node_wal_flush_seconds",
    "Time to write and fsync one flush",
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=NODE,
)
WAL_SEGMENT = Gauge("cdcd_node_wal_segment", "Index of the active WAL segment", registry=NODE)
WAL_DISK_FULL = Gauge("cdcd_node_wal_disk_full", "1 while WAL writes wait for free space on a full disk", registry=NODE)
SEGMENTS_ARCHIVED = Counter("cdcd_node_segments_archived_total", "Segments moved to the archive", registry=NODE)
CDC_LINKS = Counter("cdcd_node_cdc_links_total", "Archived segments hard-linked into the CDC dir", registry=NODE)
CDC_LINKS_SKIPPED = Counter(
    "cdcd_node_cdc_links_skipped_total",
    "Archived segments NOT linked: the CDC dir was over cdc_dir_max_bytes, or CDC was switched off",
    registry=NODE,
)
CDC_DISABLED = Gauge(
    "cdcd_node_cdc_disabled", "1 while CDC links are switched off (cdcd control cdc off)", registry=NODE
)
TTL_EXPIRED = Counter(
    "cdcd_node_ttl_expired_total", "Expired entries deleted by the expirer (DELETEs written)", registry=NODE
)
ARCHIVE_DELETED = Counter(
    "cdcd_node_archive_segments_deleted_total", "Archived segments deleted by retention", registry=NODE
)
CHECKPOINTS = Counter("cdcd_node_checkpoints_total", "Checkpoints written to the page store", registry=NODE)
CHECKPOINT_SECONDS = Histogram("cdcd_node_checkpoint_seconds", "Time to write one checkpoint to LMDB", registry=NODE)

# --- daemon ---------------------------------------------------------------------------------------
DAEMON_EVENTS = Counter(
    "cdcd_daemon_events_total", "Events confirmed by the consumer", ["cache", "op"], registry=DAEMON
)
DAEMON_BATCHES = Counter("cdcd_daemon_batches_total", "Batches handed to the consumer", ["result"], registry=DAEMON)
DAEMON_BATCH_EVENTS = Histogram(
    "cdcd_daemon_batch_events",
    "Events per batch",
    buckets=(1, 10, 100, 1000, 10_000, 50_000, 100_000, 500_000),
    registry=DAEMON,
)
DAEMON_CONSUMER_SECONDS = Histogram(
    "cdcd_daemon_consumer_call_seconds",
    "Time spent in one consumer on_events call",
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
    registry=DAEMON,
)
DAEMON_CONSUMER_RETRIES = Counter(
    "cdcd_daemon_consumer_retries_total",
    "Backoff steps after a consumer's transient failure (RetriableError), before the same events go again",
    registry=DAEMON,
)
DAEMON_DEAD_LETTERS = Counter(
    "cdcd_daemon_dead_letters_total",
    "Events the consumer refused for good, set aside as dead letters ([consumer] dead_letters)",
    ["cache"],
    registry=DAEMON,
)
DAEMON_COMMIT_SECONDS = Histogram(
    "cdcd_daemon_commit_seconds", "Time to persist the state (synced LMDB txn)", registry=DAEMON
)
DAEMON_COMMITTED_SEGMENT = Gauge("cdcd_daemon_committed_segment", "Segment of the committed position", registry=DAEMON)
DAEMON_COMMITTED_OFFSET = Gauge("cdcd_daemon_committed_offset", "Offset of the committed position", registry=DAEMON)
DAEMON_CURRENT_SEGMENT = Gauge("cdcd_daemon_current_segment", "Segment the reader is in", registry=DAEMON)
DAEMON_SEGMENTS_PENDING = Gauge(
    "cdcd_daemon_segments_pending", "Links in the CDC dir not yet fully consumed", registry=DAEMON
)
DAEMON_LAG_SECONDS = Gauge(
    "cdcd_daemon_lag_seconds",
    "now - commit time of the oldest entry not yet confirmed by the consumer (0: none; never negative)",
    registry=DAEMON,
)
DAEMON_EVENT_CAPTURE_SECONDS = BulkHistogram(
    "cdcd_daemon_event_capture_seconds",
    "Per event: WAL commit to hand-over to the consumer (Ignite's EventCaptureTime)",
    (0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600),
    DAEMON,
)
DAEMON_SEGMENT_CONSUMING_SECONDS = Histogram(
    "cdcd_daemon_segment_consuming_seconds",
    "Per segment: first read to the commit past its end (Ignite's SegmentConsumingTime)",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
    registry=DAEMON,
)
DAEMON_LAST_COMMIT = Gauge(
    "cdcd_daemon_last_commit_timestamp_seconds", "Wall time of the last state commit", registry=DAEMON
)
DAEMON_MODE = Gauge(
    "cdcd_daemon_mode",
    "1 for who delivers as the daemon persisted it (DAEMON_ACTIVE or NODE_ACTIVE)",
    ["mode"],
    registry=DAEMON,
)
DAEMON_MODE_SWITCHES = Counter(
    "cdcd_daemon_mode_switches_total", "Hand-overs (node_to_daemon, daemon_to_node)", ["direction"], registry=DAEMON
)
DAEMON_CONSUMER_UP = Gauge(
    "cdcd_daemon_consumer_up",
    "1 while the named consumer delivers (or waits out a transient failure), 0 once it stopped for good",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_CONSUMER_EVENTS = Counter(
    "cdcd_daemon_consumer_events_total", "Events confirmed by the named consumer", ["consumer"], registry=DAEMON
)
DAEMON_CONSUMER_COMMITTED_SEGMENT = Gauge(
    "cdcd_daemon_consumer_committed_segment",
    "Segment of the named consumer's committed position",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_CONSUMER_LAST_COMMIT = Gauge(
    "cdcd_daemon_consumer_last_commit_timestamp_seconds",
    "Wall time of the named consumer's last state commit",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_CONSUMER_LAG_SECONDS = Gauge(
    "cdcd_daemon_consumer_lag_seconds",
    "Now minus the commit time of the oldest entry the named consumer has not confirmed",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_CONSUMER_INVALIDATIONS = Counter(
    "cdcd_daemon_consumer_invalidations_total",
    "Named consumers invalidated for holding back more than their max_retained_bytes of links",
    ["consumer"],
    registry=DAEMON,
)
CONSUMER_STATES = ("delivering", "retrying", "stopped", "invalidated")
"""What ``cdcd_daemon_consumer_state`` and ``cdcd top`` say of a consumer: it delivers (or waits for
events), it retries a transient failure, it stopped for good (until the daemon's restart), or it was
invalidated (until ``cdcd state reset --consumer``)."""
DAEMON_CONSUMER_STATE = Gauge(
    "cdcd_daemon_consumer_state",
    "1 for the named consumer's state (delivering, retrying, stopped, invalidated), 0 for the others",
    ["consumer", "state"],
    registry=DAEMON,
)
DAEMON_CONSUMER_RETAINED_BYTES = Gauge(
    "cdcd_daemon_consumer_retained_bytes",
    "Bytes of CDC links from the named consumer's committed position on (what max_retained_bytes caps)",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_CONSUMER_MAX_RETAINED_BYTES = Gauge(
    "cdcd_daemon_consumer_max_retained_bytes",
    "The named consumer's max_retained_bytes (0: no cap)",
    ["consumer"],
    registry=DAEMON,
)
DAEMON_LINKS_DELETED = Counter("cdcd_daemon_links_deleted_total", "Consumed segment links deleted", registry=DAEMON)
DAEMON_WAITING_FOR_NODE = Gauge(
    "cdcd_daemon_waiting_for_node", "1 while the daemon waits for its node's directories to appear", registry=DAEMON
)
DAEMON_REWINDS = Counter(
    "cdcd_daemon_rewinds_total",
    "Starts that moved the position back because the consumer's target lost delivered records",
    registry=DAEMON,
)
DAEMON_RELINKED_SEGMENTS = Counter(
    "cdcd_daemon_relinked_segments_total",
    "Segments hard-linked back from the node's archive to re-deliver what a target lost",
    registry=DAEMON,
)

# --- node: realtime CDC -------------------------------------------------------------------------------
RT_MODE = Gauge("cdcd_node_realtime_mode", "1 for the realtime worker's current mode", ["mode"], registry=NODE)
RT_BUFFER_BYTES = Gauge(
    "cdcd_node_realtime_buffer_bytes", "Flushed WAL bytes held by the realtime worker", registry=NODE
)
RT_BUFFER_MAX_USED_BYTES = Gauge(
    "cdcd_node_realtime_buffer_max_used_bytes", "Highest buffer use since open", registry=NODE
)
RT_COMMITTED_SEGMENT = Gauge(
    "cdcd_node_realtime_committed_segment", "Segment of the realtime committed position", registry=NODE
)
RT_COMMITTED_OFFSET = Gauge(
    "cdcd_node_realtime_committed_offset", "Offset of the realtime committed position", registry=NODE
)
RT_LAG_SEGMENTS = Gauge("cdcd_node_realtime_lag_segments", "Active WAL segment - committed segment", registry=NODE)
RT_LAG_SECONDS = Histogram(
    "cdcd_node_realtime_lag_seconds",
    "WAL commit of a batch's first (oldest) event to consumer confirmation, per batch: the longest any of its "
    "events waited",
    buckets=(0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 1, 2, 5),
    registry=NODE,
)
RT_RESTORED_RECORDS = Gauge(
    "cdcd_node_realtime_restored_records", "WAL records re-read at the last restore", registry=NODE
)
RT_STOPS = Counter("cdcd_node_realtime_stops_total", "Realtime stops", ["reason"], registry=NODE)
RT_EVENTS = Counter("cdcd_node_realtime_events_total", "Events confirmed by the realtime consumer", registry=NODE)
RT_CONSUMER_RETRIES = Counter(
    "cdcd_node_realtime_consumer_retries_total",
    "Backoff steps after the realtime consumer's transient failure (RetriableError)",
    registry=NODE,
)

# --- lake sink ------------------------------------------------------------------------------------
LAKE_ROWS = Counter("cdcd_lake_rows_written_total", "Change-log rows landed in the lake", ["cache"], registry=LAKE)
LAKE_WRITE_SECONDS = Histogram(
    "cdcd_lake_spark_write_seconds",
    "Time to write one batch's change files to staging (by Spark or pyarrow: the sink's writer option)",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
    registry=LAKE,
)
LAKE_LAG_SECONDS = Gauge(
    "cdcd_lake_lag_seconds", "now - commit time of the last landed event (never negative)", registry=LAKE
)
LAKE_DUPLICATE_BATCHES = Counter(
    "cdcd_lake_batches_skipped_total",
    "Batches (or parts) dropped as replays at or below the high-water mark",
    registry=LAKE,
)
LAKE_RESCUED = Counter(
    "cdcd_lake_rescued_fields_total",
    "Fields that did not fit their typed-table column and were kept as JSON in _rescued",
    ["cache"],
    registry=LAKE,
)
LAKE_TABLE_FAILURES = Counter(
    "cdcd_lake_typed_table_failures_total",
    "Typed tables a compaction skipped (unreadable, or their compaction failed); state and the other tables went on",
    ["cache"],
    registry=LAKE,
)
LAKE_CONFLICTS = Counter(
    "cdcd_lake_log_conflicts_total", "Commits retried because another writer committed first", registry=LAKE
)
LAKE_MAINTENANCE_CONFLICTS = Counter(
    "cdcd_lake_maintenance_conflicts_total",
    "Scheduled maintenance runs that lost to another writer's concurrent commit (retried, not failures)",
    ["task"],
    registry=LAKE,
)
LAKE_COMMIT_FAILURES = Counter(
    "cdcd_lake_commit_failures_total",
    "Batches whose landing failed with an error (store unreachable, disk full, commit refused), retried or not",
    registry=LAKE,
)
LAKE_MAINTENANCE_FAILURES = Counter(
    "cdcd_lake_maintenance_failures_total",
    "Scheduled maintenance runs that failed (conflicts with another writer are not failures)",
    ["task"],
    registry=LAKE,
)
LAKE_LAST_MAINTENANCE = Gauge(
    "cdcd_lake_last_maintenance_timestamp_seconds",
    "Wall time at the end of the last successful scheduled maintenance run",
    ["task"],
    registry=LAKE,
)
LAKE_MAINTENANCE_SECONDS = Histogram(
    "cdcd_lake_maintenance_duration_seconds",
    "Duration of each successful scheduled maintenance run (compact: MERGE into state; optimize: bin-packing)",
    ["task"],
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=LAKE,
)
LAKE_LAST_MAINTENANCE_SECONDS = Gauge(
    "cdcd_lake_last_maintenance_duration_seconds",
    "Duration of the last successful scheduled maintenance run (its end: cdcd_lake_last_maintenance_timestamp_seconds)",
    ["task"],
    registry=LAKE,
)
LAKE_VACUUM_DELETED_BYTES = Counter(
    "cdcd_lake_vacuum_deleted_bytes_total",
    "Bytes of replaced, change data feed and orphan files the scheduled vacuum deleted (table: changes, state "
    "or tables, the typed tables together)",
    ["table"],
    registry=LAKE,
)
LAKE_LOG_FILES = Gauge(
    "cdcd_lake_log_files",
    "Files in a table's Delta log after the maintainer's last cleanup (each refresh and commit lists them all; "
    "grows while compaction is behind)",
    ["table"],
    registry=LAKE,
)
LAKE_FILES_PER_PARTITION_MAX = Gauge(
    "cdcd_lake_files_per_partition_max",
    "Most data files in one partition of the changes table: set after each of this sink's commits, from the "
    "Delta snapshot the sink holds (brought up to date with the log's new entries)",
    registry=LAKE,
)
LAKE_SMALL_FILES_PER_PARTITION_MAX = Gauge(
    "cdcd_lake_small_files_per_partition_max",
    "Most files below full size (64 MiB) in one partition of the changes table, what max_files_per_partition "
    "bounds (full-size files are never rewritten and grow with the data): set with "
    "cdcd_lake_files_per_partition_max",
    registry=LAKE,
)
LAKE_FILES_BOUND_WAITING = Gauge(
    "cdcd_lake_files_bound_waiting",
    "1 while a commit to changes waits for the small-file rewrites because it would take a partition past "
    "max_files_per_partition: delivery goes at the rewrites' pace",
    registry=LAKE,
)
LAKE_FILES_BOUND_WAIT_SECONDS = Counter(
    "cdcd_lake_files_bound_wait_seconds_total",
    "Seconds commits to changes waited for the small-file rewrites (max_files_per_partition); a rate near 1: "
    "the rewrites do not keep up and hold delivery back",
    registry=LAKE,
)
LAKE_TABLE_VERSION = Gauge(
    "cdcd_lake_table_version", "Version of the changes table after this sink's last commit", registry=LAKE
)
LAKE_GENERATIONS = Counter(
    "cdcd_lake_source_generations_total",
    "New generations started because a source's history diverged from what the lake landed",
    registry=LAKE,
)
LAKE_MAINTENANCE_BY_NEIGHBOUR = Counter(
    "cdcd_lake_maintenance_by_neighbour_total",
    "Scheduled maintenance runs a neighbour (another writer on the same lake) had done already: a compaction "
    "that lost to one folding the same changes, an OPTIMIZE skipped after a recent one",
    ["task"],
    registry=LAKE,
)

# --- replication ------------------------------------------------------------------------------------
REPL_RECEIVED = Counter(
    "cdcd_replication_received_entries_total",
    "Replicated entries this node received, by the resolver rule that decided (or 'duplicate')",
    ["rule"],
    registry=REPLICATION_ENDPOINT,
)
REPL_REJECTED = Counter(
    "cdcd_replication_rejected_entries_total", "Replicated entries the resolver rejected", registry=REPLICATION_ENDPOINT
)
REPL_REFUSED = Counter(
    "cdcd_replication_refused_total",
    "Connections or requests the replication endpoint refused",
    ["reason"],
    registry=REPLICATION_ENDPOINT,
)
REPL_CONNECTIONS = Gauge(
    "cdcd_replication_connections", "Open connections to the replication endpoint", registry=REPLICATION_ENDPOINT
)
REPL_SENT_EVENTS = Counter(
    "cdcd_replication_sent_events_total",
    "Events the replication consumer sent and had applied",
    registry=REPLICATION_SENDER,
)
REPL_SKIPPED_EVENTS = Counter(
    "cdcd_replication_skipped_events_total",
    "Events not sent: replicated from elsewhere (no loops) or backup copies",
    ["reason"],
    registry=REPLICATION_SENDER,
)
REPL_SENT_REQUESTS = Counter(
    "cdcd_replication_sent_requests_total", "Apply requests answered by the target", registry=REPLICATION_SENDER
)
REPL_SENT_BYTES = Counter(
    "cdcd_replication_sent_bytes_total", "Bytes of apply requests sent", registry=REPLICATION_SENDER
)
REPL_LAST_BATCH = Gauge(
    "cdcd_replication_last_batch_timestamp_seconds",
    "Wall time of the last fully applied batch",
    registry=REPLICATION_SENDER,
)
REPL_APPLY_SECONDS = Histogram(
    "cdcd_replication_apply_seconds",
    "Apply request sent to reply received (the target's resolver, WAL append and fsync included)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
    registry=REPLICATION_SENDER,
)
REPL_RETRIES = Counter(
    "cdcd_replication_retries_total", "Reconnects after a failed connection or request", registry=REPLICATION_SENDER
)
REPL_CONFLICTS = Counter(
    "cdcd_replication_rejected_by_target_total",
    "Entries the target's resolver rejected (from its replies)",
    registry=REPLICATION_SENDER,
)

# --- Kafka (cdcd/kafka/): the sink, and kafka-to-node ---------------------------------------------
KAFKA_SINK = CollectorRegistry(auto_describe=True)
"""The Kafka sink, wherever it runs (daemon or the node's realtime worker)."""
KAFKA_TO_NODE = CollectorRegistry(auto_describe=True)
"""``cdcd kafka-to-node`` (Ignite's kafka-to-ignite metrics)."""

KAFKA_SENT_EVENTS = Counter(
    "cdcd_kafka_sent_events_total", "Changes in committed Kafka transactions", ["cache"], registry=KAFKA_SINK
)
KAFKA_SKIPPED_EVENTS = Counter(
    "cdcd_kafka_skipped_events_total",
    "Changes not sent: already in Kafka (at or below the stored position) or backup copies",
    ["reason"],
    registry=KAFKA_SINK,
)
KAFKA_TRANSACTIONS = Counter("cdcd_kafka_transactions_total", "Kafka transactions committed", registry=KAFKA_SINK)
KAFKA_TRANSACTION_ABORTS = Counter(
    "cdcd_kafka_transaction_aborts_total",
    "Kafka transactions begun and not committed: dropped after an error (the next producer's init aborts them) "
    "or aborted at stop",
    registry=KAFKA_SINK,
)
KAFKA_RETRIES = Counter(
    "cdcd_kafka_retries_total", "Batches retried with a new producer after a Kafka error", registry=KAFKA_SINK
)
KAFKA_METADATA_RECORDS = Counter(
    "cdcd_kafka_metadata_records_total",
    "Cache created/destroyed records sent to the metadata topic",
    registry=KAFKA_SINK,
)
KAFKA_LAST_COMMIT = Gauge(
    "cdcd_kafka_last_commit_timestamp_seconds", "Wall time of the last committed transaction", registry=KAFKA_SINK
)
KAFKA_COMMIT_SECONDS = Histogram(
    "cdcd_kafka_commit_seconds",
    "commit_transaction() duration (the flush of the transaction's messages included)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=KAFKA_SINK,
)

K2N_RECEIVED = Counter(
    "cdcd_kafka_to_node_events_received_total",
    "Messages read from the data topics: each is applied, ignored, rejected or skipped",
    registry=KAFKA_TO_NODE,
)
K2N_APPLIED = Counter("cdcd_kafka_to_node_events_applied_total", "Changes the target applied", registry=KAFKA_TO_NODE)
K2N_IGNORED = Counter(
    "cdcd_kafka_to_node_events_ignored_total",
    "Changes the target already had (a replay after a restart): neither applied nor conflicts",
    registry=KAFKA_TO_NODE,
)
K2N_REJECTED = Counter(
    "cdcd_kafka_to_node_events_rejected_total", "Changes the target's resolver rejected", registry=KAFKA_TO_NODE
)
K2N_SKIPPED = Counter(
    "cdcd_kafka_to_node_skipped_messages_total",
    "Messages not applied as changes: tombstones, caches not selected, replicated from elsewhere, truncates "
    "(each applied as one cache drop)",
    ["reason"],
    registry=KAFKA_TO_NODE,
)
K2N_MARKERS = Counter(
    "cdcd_kafka_to_node_markers_total", "Metadata records (cache created/destroyed) read", registry=KAFKA_TO_NODE
)
K2N_LAST_BATCH = Gauge(
    "cdcd_kafka_to_node_last_batch_timestamp_seconds",
    "Wall time of the last batch applied and committed",
    registry=KAFKA_TO_NODE,
)
K2N_RETRIES = Counter(
    "cdcd_kafka_to_node_retries_total", "Batches retried after a failing target", registry=KAFKA_TO_NODE
)
