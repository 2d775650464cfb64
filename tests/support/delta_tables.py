"""Delta change tables made directly (delta-rs), as the lake writers lay them out: the contract of
``cdcd/lake/table.py`` (schema, partitioning, properties), one commit per ``append_changes``, with
an application transaction per source when given. For compaction, maintenance and reader tests."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake

from cdcd.lake.table import CHANGE_SCHEMA, CHANGES, CHANGES_PROPERTIES, PARTITION_BY

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def change(
    cache: str,
    key: str,
    value: str | None,
    version: int,
    *,
    op: str | None = None,
    segment: int = 0,
    offset: int | None = None,
    index: int = 0,
    source: str = "node-a",
) -> dict[str, Any]:
    """One change row; ``value`` None is a delete. WAL offset defaults to the version (a plausible order)."""
    return {
        "op": op or ("delete" if value is None else "update"),
        "key": key,
        "value": value,
        "partition": 0,
        "primary": True,
        "version_order": version,
        "version_cluster_id": 1,
        "node_order": 1,
        "topology_version": 1,
        "commit_ts": EPOCH + dt.timedelta(milliseconds=version),
        "source_node": source,
        "wal_segment": segment,
        "wal_offset": version * 16 if offset is None else offset,
        "wal_index": index,
        "expire_time_ms": 0,
        "cache": cache,
    }


def append_changes(lake: Path, rows: Iterable[dict[str, Any]], *, source_txn: tuple[str, int] | None = None) -> int:
    """One commit appending ``rows`` to ``<lake>/changes`` (created on first use); returns the new version."""
    table = pa.Table.from_pylist(list(rows), schema=CHANGE_SCHEMA)
    props = None
    if source_txn is not None:
        props = CommitProperties(app_transactions=[Transaction(app_id=source_txn[0], version=source_txn[1])])
    path = lake / CHANGES
    write_deltalake(
        str(path),
        table,
        mode="append",
        partition_by=list(PARTITION_BY),
        configuration=CHANGES_PROPERTIES,
        commit_properties=props,
    )
    from deltalake import DeltaTable

    return DeltaTable(str(path)).version()


def expected_state(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(cache, key) -> value of the latest change by version order, then WAL position; deletes removed."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        k = (row["cache"], row["key"])
        order = (row["version_order"], row["wal_segment"], row["wal_offset"], row["wal_index"])
        cur = best.get(k)
        if cur is None or order > (cur["version_order"], cur["wal_segment"], cur["wal_offset"], cur["wal_index"]):
            best[k] = row
    return {k: r["value"] for k, r in best.items() if r["op"] != "delete"}


def state_rows(lake: Path) -> dict[tuple[str, str], str]:
    """``<lake>/state`` as (cache, key) -> value, read with delta-rs; asserts one row per key."""
    from deltalake import DeltaTable

    table = DeltaTable(str(lake / "state")).to_pyarrow_table(columns=["cache", "key", "value"])
    out: dict[tuple[str, str], str] = {}
    columns = [table.column(name).to_pylist() for name in ("cache", "key", "value")]
    for cache, key, value in zip(*columns, strict=True):
        assert (cache, key) not in out, f"two state rows for {(cache, key)}"
        out[(cache, key)] = value
    return out


def compacted_lake(lake: Path, rows: list[dict[str, Any]]) -> None:
    """A lake whose ``changes`` hold ``rows`` (one commit) and whose ``state`` is their fold, written
    with delta-rs as ``lake compact`` would leave it (its application transaction included), no JVM."""
    from cdcd.lake.maintenance.compact import COMPACT_APP_ID
    from cdcd.lake.table import STATE, STATE_PROPERTIES, STATE_SCHEMA

    version = append_changes(lake, rows)
    latest = expected_state(rows)
    state_rows_ = [
        {name: r.get(name) for name in STATE_SCHEMA.names}
        for r in rows
        if (r["cache"], r["key"]) in latest and latest[(r["cache"], r["key"])] == r["value"]
    ]
    write_deltalake(
        str(lake / STATE),
        pa.Table.from_pylist(state_rows_, schema=STATE_SCHEMA),
        mode="append",
        partition_by=list(PARTITION_BY),
        configuration=STATE_PROPERTIES,
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id=COMPACT_APP_ID, version=version)]),
    )
