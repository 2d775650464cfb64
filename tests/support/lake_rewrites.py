"""The bound's rewrites of ``changes`` as its log and its directory show them (cdcd/lake/maintenance/autocompact.py):
files per partition at every version, which commits are rewrites, files no version holds (orphans) and what
they hold, and ``changes`` against the WAL entry by entry."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from cdcd.lake.maintenance.autocompact import COMMIT_TAG
from cdcd.lake.table import CHANGES
from tests.support.delta_lake import lake_rows


@dataclass
class Version:
    """One commit of a table's log: what it added and removed (paths), and what kind of commit it is."""

    version: int
    rewrite: bool
    """A rewrite by the bound (``commitInfo.cdcd`` says ``autocompact``)."""
    marks: list[str]
    """Application transactions it moved (a batch of the sink: the source's mark)."""
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    partitions_added: set[tuple[tuple[str, Any], ...]] = field(default_factory=set)
    partitions_removed: set[tuple[tuple[str, Any], ...]] = field(default_factory=set)


def _key(values: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((values or {}).items()))


def versions(table: Path) -> list[Version]:
    """Every commit of the Delta table at ``table``, from its ``_delta_log`` JSON entries, in order."""
    out: list[Version] = []
    for entry in sorted((table / "_delta_log").glob("*.json")):
        v = Version(int(entry.stem), False, [])
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "commitInfo" in action:
                meta = action["commitInfo"].get("cdcd")
                v.rewrite = bool(meta) and COMMIT_TAG in json.loads(meta)
            elif "txn" in action:
                v.marks.append(action["txn"]["appId"])
            elif "add" in action:
                v.added.append(unquote(action["add"]["path"]))
                v.partitions_added.add(_key(action["add"].get("partitionValues")))
            elif "remove" in action:
                v.removed.append(unquote(action["remove"]["path"]))
                v.partitions_removed.add(_key(action["remove"].get("partitionValues")))
        out.append(v)
    return out


def most_files_at_every_version(table: Path) -> list[tuple[int, int]]:
    """``(version, most live files in one partition)`` for every version of the table's log (a file's
    partition: its directory)."""
    live: set[str] = set()
    out: list[tuple[int, int]] = []
    for v in versions(table):
        live -= set(v.removed)
        live |= set(v.added)
        per_dir = Counter(path.rpartition("/")[0] for path in live)
        out.append((v.version, max(per_dir.values(), default=0)))
    return out


def orphans(lake: Path) -> set[str]:
    """Parquet files under ``changes`` that no version of its log ever added (written, never committed)."""
    changes = lake / CHANGES
    on_disk = {str(p.relative_to(changes)) for p in changes.rglob("*.parquet") if "_delta_log" not in p.parts}
    in_log = {path for v in versions(changes) for path in (*v.added, *v.removed)}
    return on_disk - in_log


def split_orphans(lake: Path) -> tuple[set[str], set[str]]:
    """Orphans as (a rewrite's merged files: every record they hold is landed already, the next batch's
    files: none of their records is landed, or cut short by the kill: a merged file is fsynced before its
    commit is tried, a batch's file may be killed in the middle of its writing). Raises on a file that is
    neither."""
    rows = lake_rows(lake)
    landed = set(zip(rows.column("wal_segment").to_pylist(), rows.column("wal_offset").to_pylist(), strict=True))
    merged: set[str] = set()
    batch: set[str] = set()
    for rel in orphans(lake):
        try:
            data = pq.read_table(lake / CHANGES / rel, columns=["wal_segment", "wal_offset"])
        except pa.ArrowInvalid:  # no Parquet footer: killed while writing it
            batch.add(rel)
            continue
        held = set(zip(data.column("wal_segment").to_pylist(), data.column("wal_offset").to_pylist(), strict=True))
        if held <= landed:
            merged.add(rel)
        elif not held & landed:
            batch.add(rel)
        else:
            raise AssertionError(f"orphan {rel} holds landed and unlanded records: {sorted(held - landed)[:3]}")
    return merged, batch


def rewrites(table: Path) -> int:
    """Commits of the table that are rewrites by the bound (their commitInfo says so)."""
    n = 0
    for entry in DeltaTable(str(table)).history():
        meta = entry.get("cdcd")
        if meta and COMMIT_TAG in json.loads(meta):
            n += 1
    return n


def same_rows_as_wal(lake: Path, events: list[dict[str, Any]]) -> None:
    """``changes`` holds exactly one row per WAL data entry, with its op, key and value."""
    rows = lake_rows(lake).to_pylist()
    by_pos = {(r["wal_segment"], r["wal_offset"], r["wal_index"]): r for r in rows}
    assert len(by_pos) == len(rows), "an entry landed twice"
    assert set(by_pos) == {tuple(e["pos"]) for e in events}
    for e in events:
        r = by_pos[tuple(e["pos"])]
        assert (r["cache"], r["op"], json.loads(r["key"])) == (e["cache"], e["op"], e["key"]), e["pos"]
        assert (json.loads(r["value"]) if r["value"] is not None else None) == (
            e["value"] if e["op"] != "delete" else None
        ), e["pos"]


def live_files(table: Path) -> set[str]:
    return set(pa.table(DeltaTable(str(table)).get_add_actions(flatten=True)).column("path").to_pylist())
