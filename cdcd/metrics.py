"""Every Prometheus metric of cdcd, declared in one place.

Metrics live in the process-wide default registry; a process runs one node and/or one daemon.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- node: WAL -----------------------------------------------------------------------------------
NODE_ENTRIES = Counter("cdcd_node_entries_total", "Entries committed to the WAL", ["op"])
NODE_TRANSACTIONS = Counter("cdcd_node_transactions_total", "DataRecords committed")
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
RECOVERY_RECORDS = Gauge("cdcd_node_recovery_records", "WAL records replayed at the last open")
