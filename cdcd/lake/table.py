"""The Delta lake's two tables: where they live, their columns, partitioning and properties.

One place that every writer (Spark and delta-rs), ``lake compact`` and the readers agree on.
``<lake>/changes`` is append-only with the change data feed on; ``<lake>/state`` holds the latest
version of every live key. The properties keep both tables readable by Spark, delta-rs, polars and
DuckDB: no deletion vectors, no column mapping, no v2 checkpoints. Application transactions (the
per-source high-water marks that make landing exactly once) must never expire: the tables never set
``delta.setTransactionRetentionDuration`` (unset, Delta keeps them through every checkpoint).
"""

from __future__ import annotations

import pyarrow as pa

CHANGES = "changes"
STATE = "state"
CUTS = "_cuts"
"""The cuts table (``cdcd/lake/cuts.py``)."""
TABLES = "tables"
"""The directory of the typed tables, one per cache (``cdcd/lake/typed/layout.py``)."""

CHANGE_SCHEMA = pa.schema(
    [
        ("op", pa.string()),
        ("key", pa.string()),
        ("value", pa.string()),
        ("partition", pa.int32()),
        ("primary", pa.bool_()),
        ("version_order", pa.int64()),
        ("version_cluster_id", pa.int32()),
        ("node_order", pa.int32()),
        ("topology_version", pa.int64()),
        ("commit_ts", pa.timestamp("us", tz="UTC")),
        ("source_node", pa.string()),
        ("wal_segment", pa.int64()),
        ("wal_offset", pa.int64()),
        ("wal_index", pa.int32()),
        ("expire_time_ms", pa.int64()),
        ("cache", pa.string()),
        ("source_generation", pa.int32()),
    ]
)
"""``op``: "create" | "update" | "delete". ``key``/``value``: the entry as JSON text (``value`` null
on a delete). ``expire_time_ms``: when the entry expires (ms since the epoch, 0: never); on a delete,
non-zero means the node's expirer removed it. ``day`` ("YYYY-MM-DD" of ``commit_ts``) is appended
when the sink partitions by day. ``source_generation``: 0, or n when the source's history diverged
from what the lake had landed n times (a node dir restored from a backup reuses WAL positions): order
one source's changes by (source_generation, wal_segment, wal_offset, wal_index)."""

ORDER_COLUMNS = ("topology_version", "version_order", "node_order", "wal_segment", "wal_offset", "wal_index")
"""Which change of a key wins, in ``state`` and in the typed tables alike: the highest version as Ignite's
``GridCacheVersion.compareTo`` orders them (topology version, then order, then node order: a node re-created
or restored from a backup counts its order from scratch or from the backup's, its topology version grows),
then the latest WAL position."""

DAY_FIELD = pa.field("day", pa.string())

_CHANGE_ONLY = ("op", "partition", "primary", "source_generation")
STATE_SCHEMA = pa.schema([CHANGE_SCHEMA.field(name) for name in CHANGE_SCHEMA.names if name not in _CHANGE_ONLY])
"""One row per live (cache, key): the change with the highest version, then WAL position."""

PARTITION_BY = ("cache",)
"""Both tables; the changes table adds ``day`` when the sink partitions by day."""

COMMON_PROPERTIES = {
    "delta.enableDeletionVectors": "false",
    "delta.checkpointPolicy": "classic",
    "delta.columnMapping.mode": "none",
}

RANDOM_PREFIXES = {"delta.randomizeFilePrefixes": "true"}
"""On both tables partitioned by ``cache``: the files Spark writes into them (state's MERGE, OPTIMIZE of
either) go under a random two-character directory, not Spark's ``cache=<escaped name>`` (a NUL is an
invalid path, 255 characters or 200 x "é" a file name too long; Delta's commit protocol cannot be
given another naming). cdcd's own writers ignore the property and name a partition's directory
``cache=<partition_dir_value>``. Readers take the cache from the log or the column, never from a path."""

CHANGES_LOG_PROPERTIES = {
    "delta.logRetentionDuration": "interval 2 minutes",
    "delta.deletedFileRetentionDuration": "interval 10 minutes",
    "delta.enableExpiredLogCleanup": "false",
}
"""How long ``changes`` keeps its log and its removed files' tombstones. Live traffic commits it once a second or
more (the realtime worker a dozen times); every commit and refresh lists the whole log, so the log is kept
shortest; a checkpoint writes every tombstone, but checkpoints are written off the commit path, and tombstones
keep ``lake vacuum`` from deleting a file a reader of an older snapshot may still read. Delta's defaults (a month
of log, a week of tombstones) would slow every commit by the hour. The table is append-only, its rows are the
history; its log needs to reach back as far as compaction (which the cleanup never outruns) and change-feed
readers do. cdcd's maintainer removes the old log files after each compaction
(cdcd/lake/maintenance/log_cleanup.py), so Delta's own cleanup, which does not know what compaction still reads,
is off. Set on an older ``changes`` that lacks them when a sink opens it; a value set by hand is kept."""

CHANGES_PROPERTIES = {
    **COMMON_PROPERTIES,
    **RANDOM_PREFIXES,
    **CHANGES_LOG_PROPERTIES,
    "delta.enableChangeDataFeed": "true",
    "delta.appendOnly": "true",
}
FOLDED_PROPERTIES = {"delta.checkpointInterval": "10"}
"""On the tables compaction folds into (``state`` and the typed tables): a checkpoint every 10 commits, as Spark
writes by default, not delta-rs's 100. Compaction commits each a few times a minute and opens each several times
a run; every open replays the commits since the last checkpoint, so at 100 a run's cost grew for half an hour
before each checkpoint (docs/performance.md). Set on an older table that lacks it by the next compaction; a value
set by hand is kept."""

STATE_PROPERTIES = {
    **COMMON_PROPERTIES,
    **RANDOM_PREFIXES,
    **FOLDED_PROPERTIES,
    "delta.enableChangeDataFeed": "false",
}


def change_schema(partition_by_day: bool) -> pa.Schema:
    return CHANGE_SCHEMA.append(DAY_FIELD) if partition_by_day else CHANGE_SCHEMA


def change_partitions(partition_by_day: bool) -> list[str]:
    return [*PARTITION_BY, "day"] if partition_by_day else list(PARTITION_BY)


SOURCE_APP_PREFIX = "cdcd:"
"""Application transaction ids of the changes table: ``cdcd:<source node id>`` for a source's first
generation, ``cdcd:<source node id>:g<n>`` for generation n (see cdcd/lake/landing/delta.py)."""
