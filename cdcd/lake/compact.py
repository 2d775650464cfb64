"""``cdcd lake compact``: MERGE the changes since the last compaction into ``<lake>/state``.

One Spark job for all caches. It reads the change data feed of ``<lake>/changes`` from the version
after the last compacted one up to the table's current version, keeps per (cache, key) the change
with the highest version order, then WAL position, and MERGEs that into ``state``: deletes remove
the row, anything else replaces an older one. The MERGE commit carries the application
transaction ``(COMPACT_APP_ID, changes version compacted up to)``: Delta skips a commit whose
version is not above the recorded one, so a compaction that died (anywhere, even after its commit)
and runs again either finds nothing left to do or redoes exactly the uncommitted range.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import structlog

from cdcd import failpoints
from cdcd.lake.deltalog import data_changing_versions
from cdcd.lake.table import CHANGES, PARTITION_BY, STATE, STATE_PROPERTIES, STATE_SCHEMA

log = structlog.get_logger("cdcd.lake")

COMPACT_APP_ID = "cdcd-compact"
"""The state table's application transaction: its version is the changes-table version compacted up to."""

ORDER_COLUMNS = ("version_order", "wal_segment", "wal_offset", "wal_index")
"""Which change of a key wins: the highest version order, then the latest WAL position."""

STATE_COLUMNS = tuple(STATE_SCHEMA.names)
_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"


class NotADeltaLake(ValueError):
    """``<lake>/changes`` is not a Delta table."""


@dataclass(frozen=True)
class CompactResult:
    from_version: int
    """First changes-table version folded in (-1: nothing to do)."""
    to_version: int
    """The changes-table version ``state`` now reflects (the compact application transaction)."""
    keys: int
    """Distinct (cache, key) merged."""
    state_version: int
    """The state table's version after the MERGE (unchanged when nothing was new)."""

    @property
    def did_work(self) -> bool:
        return self.from_version >= 0


def spark_type(t: pa.DataType) -> str:
    """Spark SQL type of a table-contract column (the contract uses only these)."""
    if pa.types.is_string(t):
        return "STRING"
    if pa.types.is_int32(t):
        return "INT"
    if pa.types.is_int64(t):
        return "BIGINT"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_timestamp(t):
        return "TIMESTAMP"
    raise TypeError(f"no Spark type for {t}")


def spark_ddl(schema: pa.Schema) -> str:
    return ", ".join(f"`{f.name}` {spark_type(f.type)}" for f in schema)


def table_version(path: Path) -> int | None:
    """The latest version of the Delta table at ``path`` (None: no table there). Reads the log only."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(str(path)):
        return None
    return DeltaTable(str(path)).version()


def compacted_version(lake: Path) -> int:
    """The changes-table version ``state`` reflects (-1: never compacted)."""
    from deltalake import DeltaTable

    state = lake / STATE
    if not DeltaTable.is_deltatable(str(state)):
        return -1
    version = DeltaTable(str(state)).transaction_version(COMPACT_APP_ID)
    return -1 if version is None else int(version)


def ensure_state_table(spark: Any, lake: Path) -> None:
    """Create ``<lake>/state`` (empty, the contract's schema, partitioning and properties) if absent."""
    from delta.tables import DeltaTable

    builder = DeltaTable.createIfNotExists(spark).location(str(lake / STATE))
    for field in STATE_SCHEMA:
        builder = builder.addColumn(field.name, spark_type(field.type))
    builder = builder.partitionedBy(*PARTITION_BY)
    for key, value in STATE_PROPERTIES.items():
        builder = builder.property(key, value)
    builder.execute()


def latest_changes(spark: Any, changes: Path, start: int, end: int) -> Any:
    """Per (cache, key), the winning change among versions ``start..end`` of the change data feed."""
    from pyspark.sql import functions as F

    feed = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", start)
        .option("endingVersion", end)
        .load(str(changes))
        # The table is append-only: every row of its feed is an insert.
        .where(F.col("_change_type") == "insert")
    )
    rest = [c for c in STATE_COLUMNS if c not in ("cache", "key", *ORDER_COLUMNS)]
    # max of a struct compares field by field: the ordering columns first decide the winner.
    winner = F.max(F.struct(*[F.col(c) for c in ORDER_COLUMNS], F.col("op"), *[F.col(c) for c in rest]))
    return feed.groupBy("cache", "key").agg(winner.alias("w")).select("cache", "key", "w.*")


def _newer(source: str, target: str) -> str:
    """SQL: the source row's change is later than the target row's (struct comparison, field by field)."""
    cols = ", ".join(f"{source}.{c}" for c in ORDER_COLUMNS)
    tcols = ", ".join(f"{target}.{c}" for c in ORDER_COLUMNS)
    return f"struct({cols}) > struct({tcols})"


def compact(spark: Any, lake: Path) -> CompactResult:
    """Fold every change committed to ``<lake>/changes`` since the last compaction into ``<lake>/state``."""
    from delta.tables import DeltaTable

    changes = lake / CHANGES
    end = table_version(changes)
    if end is None:
        raise NotADeltaLake(f"{changes}: not a Delta table (no _delta_log/): nothing to compact")
    done = compacted_version(lake)
    if not behind(changes, done, end):
        return CompactResult(-1, done, 0, _state_version(lake))
    # Its own session: the application-transaction settings are per session, and the lake sink may
    # commit through the process's main session at the same time.
    session = spark.newSession()
    ensure_state_table(session, lake)
    failpoints.hit("lake.compact.state_table")
    source = latest_changes(session, changes, done + 1, end).cache()
    try:
        rows = source.count()
        failpoints.hit("lake.compact.source_read")
        state = DeltaTable.forPath(session, str(lake / STATE))
        assignments: dict[str, str | Any] = {c: f"s.`{c}`" for c in STATE_COLUMNS}
        merge = (
            state.alias("t")
            .merge(source.alias("s"), "t.cache = s.cache AND t.key = s.key")
            .whenMatchedDelete(condition=f"s.op = 'delete' AND {_newer('s', 't')}")
            .whenMatchedUpdate(condition=f"s.op <> 'delete' AND {_newer('s', 't')}", set=assignments)
            .whenNotMatchedInsert(condition="s.op <> 'delete'", values=assignments)
        )
        session.conf.set(_TXN_APP, COMPACT_APP_ID)
        session.conf.set(_TXN_VERSION, str(end))
        merge.execute()
        failpoints.hit("lake.compact.committed")
    finally:
        source.unpersist()
    state_version = _state_version(lake)
    log.info("lake_compacted", changes_from=done + 1, changes_to=end, keys=rows, state_version=state_version)
    return CompactResult(done + 1, end, rows, state_version)


def behind(changes: Path, done: int, end: int) -> bool:
    """Whether versions ``done+1..end`` of the changes table hold data ``state`` lacks (commits that
    only rearrange files, such as OPTIMIZE, do not count)."""
    return next(data_changing_versions(changes, done, end), None) is not None


def state_lag(lake: Path) -> tuple[int, int, bool]:
    """(changes version, changes version ``state`` reflects, whether ``state`` is behind)."""
    changes = lake / CHANGES
    end = table_version(changes)
    if end is None:
        raise NotADeltaLake(f"{changes}: not a Delta table (no _delta_log/)")
    done = compacted_version(lake)
    return end, done, behind(changes, done, end)


def _state_version(lake: Path) -> int:
    version = table_version(lake / STATE)
    return -1 if version is None else version
