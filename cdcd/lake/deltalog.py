"""What ``lake show``, ``verify``, ``vacuum`` and compaction read straight from a Delta log, without a JVM.

delta-rs answers most questions (versions, history, files); two it has no call for are read here
from the log files themselves: every application transaction of a table (delta-rs looks one up by
id only) and whether the commits after a version changed data (an OPTIMIZE does not). The tables
use classic checkpoints (``delta.checkpointPolicy = classic``), the only kind this reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from cdcd.lake.storage import LakeDir, file_source

LOG_DIR = "_delta_log"


class DeltaLogError(ValueError):
    """A log file that cannot be read: ``path: what``."""


@dataclass(frozen=True)
class AppTransaction:
    app_id: str
    version: int
    last_updated_ms: int | None


def _commit_path(table: LakeDir, version: int) -> LakeDir:
    return table / LOG_DIR / f"{version:020d}.json"


def read_commit(table: LakeDir, version: int) -> list[dict[str, Any]]:
    """The actions of one commit (one JSON object per line)."""
    path = _commit_path(table, version)
    actions = []
    with path.open("rb") as f:
        data = f.read()
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            actions.append(json.loads(line))
        except ValueError as exc:
            raise DeltaLogError(f"{path} line {lineno}: not JSON ({exc})") from exc
    return actions


def last_checkpoint(table: LakeDir) -> tuple[int, list[LakeDir]] | None:
    """The newest checkpoint named by ``_last_checkpoint``: its version and part files."""
    pointer = table / LOG_DIR / "_last_checkpoint"
    if not pointer.exists():
        return None
    try:
        info = json.loads(pointer.read_bytes())
        version = int(info["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaLogError(f"{pointer}: unreadable ({exc})") from exc
    parts = int(info.get("parts") or 0)
    if parts:
        name = f"{version:020d}.checkpoint.{{:010d}}.{parts:010d}.parquet"
        files = [table / LOG_DIR / name.format(i) for i in range(1, parts + 1)]
    else:
        files = [table / LOG_DIR / f"{version:020d}.checkpoint.parquet"]
    return version, files


def app_transactions(table: LakeDir, latest: int) -> dict[str, AppTransaction]:
    """Every application transaction of the table as of version ``latest``: the newest checkpoint's,
    then the commits after it (a later txn of the same app replaces the earlier)."""
    txns: dict[str, AppTransaction] = {}
    start = 0
    checkpoint = last_checkpoint(table)
    if checkpoint is not None and checkpoint[0] <= latest:
        version, files = checkpoint
        for file in files:
            columns = pq.read_schema(file_source(file)).names
            if "txn" not in columns:
                continue
            for row in pq.read_table(file_source(file), columns=["txn"]).column("txn").to_pylist():
                if row is not None:
                    txns[row["appId"]] = AppTransaction(row["appId"], int(row["version"]), row.get("lastUpdated"))
        start = version + 1
    for version in range(start, latest + 1):
        for action in read_commit(table, version):
            txn = action.get("txn")
            if txn is not None:
                txns[txn["appId"]] = AppTransaction(txn["appId"], int(txn["version"]), txn.get("lastUpdated"))
    return txns


def data_changing_versions(table: LakeDir, after: int, latest: int) -> Iterator[int]:
    """Versions in ``after+1..latest`` that add or remove data (``dataChange``): not an OPTIMIZE,
    not a property change. A commit file already cleaned up counts as changing data (it cannot be
    told otherwise, and a caller must not assume it was empty)."""
    for version in range(after + 1, latest + 1):
        path = _commit_path(table, version)
        if not path.exists():
            yield version
            continue
        for action in read_commit(table, version):
            change = action.get("add") or action.get("remove") or action.get("cdc")
            if change is not None and change.get("dataChange", True):
                yield version
                break


def rows_added(table: LakeDir, version: int) -> int | None:
    """Rows a commit added (from its files' statistics); None when a file has none or the commit file is gone."""
    try:
        actions = read_commit(table, version)
    except FileNotFoundError:
        return None
    total = 0
    for action in actions:
        add = action.get("add")
        if add is None or not add.get("dataChange", True):
            continue
        stats = add.get("stats")
        if not stats:
            return None
        try:
            total += int(json.loads(stats)["numRecords"])
        except (ValueError, KeyError, TypeError):
            return None
    return total
