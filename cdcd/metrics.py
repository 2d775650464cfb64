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
    "cdcd_node_cdc_links_skipped_total", "Archived segments NOT linked because the CDC dir was over cdc_dir_max_bytes"
)
ARCHIVE_DELETED = Counter("cdcd_node_archive_segments_deleted_total", "Archived segments deleted by retention")
CHECKPOINTS = Counter("cdcd_node_checkpoints_total", "Checkpoints written to the page store")
CHECKPOINT_SECONDS = Histogram("cdcd_node_checkpoint_seconds", "Time to write one checkpoint to LMDB")
