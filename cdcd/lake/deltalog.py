"""What ``lake show``, ``verify``, ``vacuum`` and compaction read straight from a Delta log, without a JVM.

delta-rs answers most questions (versions, history, files); two it has no call for are read here
from the log files themselves: every application transaction of a table (delta-rs looks one up by
id only) and whether the commits after a version changed data (an OPTIMIZE does not). The tables
use classic checkpoints (``delta.checkpointPolicy = classic``), the only kind this reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cdcd.lake.storage import LakeDir, ObjectPath, file_source

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
    with path.open("rb") as f:
        return _parse_commit(path, f.read())


def _parse_commit(path: LakeDir, data: bytes) -> list[dict[str, Any]]:
    actions = []
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            actions.append(json.loads(line))
        except ValueError as exc:
            raise DeltaLogError(f"{path} line {lineno}: not JSON ({exc})") from exc
    return actions


_LOG_FILE = re.compile(r"(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)")


@dataclass(frozen=True)
class LogFile:
    version: int
    checkpoint: bool
    mtime_ms: int
    path: LakeDir

    @property
    def commit(self) -> bool:
        return self.path.name.endswith(".json")


def log_files(table: LakeDir) -> list[LogFile]:
    """Every commit, checkpoint and checksum file in the table's log (not ``_last_checkpoint``), with its mtime."""
    log_dir = table / LOG_DIR
    out: list[LogFile] = []
    if isinstance(log_dir, ObjectPath):
        from pyarrow import fs as pafs

        infos = log_dir.fs.get_file_info(pafs.FileSelector(log_dir.fs_path, allow_not_found=True))
        for info in infos:
            m = _LOG_FILE.fullmatch(info.base_name)
            if m is not None and info.type == pafs.FileType.File and info.mtime is not None:
                mtime_ms = int(info.mtime.timestamp() * 1000)
                checkpoint = m.group(2).startswith("checkpoint")
                out.append(LogFile(int(m.group(1)), checkpoint, mtime_ms, log_dir / info.base_name))
        return out
    assert isinstance(log_dir, Path)
    import os

    try:
        entries = list(os.scandir(log_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        m = _LOG_FILE.fullmatch(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        mtime_ms = int(entry.stat().st_mtime * 1000)
        out.append(LogFile(int(m.group(1)), m.group(2).startswith("checkpoint"), mtime_ms, log_dir / entry.name))
    return out


def checkpoint_at_or_before(table: LakeDir, version: int) -> tuple[int, list[LakeDir]] | None:
    """The newest checkpoint of a version at or before ``version`` found in the log: its version and part
    files (a multi-part checkpoint only when all its parts are there)."""
    by_version: dict[int, list[LakeDir]] = {}
    for f in log_files(table):
        if f.checkpoint and f.version <= version:
            by_version.setdefault(f.version, []).append(f.path)
    for found in sorted(by_version, reverse=True):
        parts = sorted(by_version[found], key=lambda p: p.name)
        if len(parts) == 1 and parts[0].name.endswith(".checkpoint.parquet"):
            return found, parts
        multi = [p for p in parts if not p.name.endswith(".checkpoint.parquet")]
        if multi and len(multi) == int(multi[0].name.rsplit(".", 2)[-2]):
            return found, multi
    return None


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


@dataclass(frozen=True)
class LogListing:
    """One reading of a table's log: its files and the checkpoint ``_last_checkpoint`` names (None: none)."""

    files: list[LogFile]
    checkpoint: tuple[int, list[LakeDir]] | None


def list_log(table: LakeDir) -> LogListing:
    return LogListing(log_files(table), last_checkpoint(table))


def _replay(
    table: LakeDir, kind: str, checkpoint: tuple[int, list[LakeDir]] | None, versions: Iterable[int]
) -> Iterator[dict[str, Any]]:
    """The ``kind`` actions (``metaData``, ``txn``) of ``checkpoint``'s files, then of the commits ``versions``,
    in log order: a later one of the same key replaces an earlier one."""
    if checkpoint is not None:
        for part in checkpoint[1]:
            if kind not in pq.read_schema(file_source(part)).names:
                continue
            for row in pq.read_table(file_source(part), columns=[kind]).column(kind).to_pylist():
                if row is not None:
                    yield row
    needle = f'"{kind}"'.encode()
    for version in versions:
        path = _commit_path(table, version)
        with path.open("rb") as f:
            data = f.read()
        if needle in data:  # most commits carry data only: parse only those that may hold one
            for action in _parse_commit(path, data):
                found = action.get(kind)
                if found is not None:
                    yield found


def configuration(table: LakeDir, listing: LogListing | None = None) -> dict[str, str]:
    """The table's properties (``metaData.configuration``) at its latest version, read from the checkpoint
    ``_last_checkpoint`` names and the commits after it: what opening the table with delta-rs would tell, without
    replaying its files' actions. ``listing``: the log as the caller read it."""
    listing = list_log(table) if listing is None else listing
    checkpoint = listing.checkpoint
    start = 0 if checkpoint is None else checkpoint[0] + 1
    found: dict[str, str] | None = None
    commits = sorted(f.version for f in listing.files if f.commit and f.version >= start)
    for meta in _replay(table, "metaData", checkpoint, commits):
        found = dict(meta.get("configuration") or {})  # a map: pairs in a checkpoint, an object in JSON
    if found is None:
        raise DeltaLogError(f"{table / LOG_DIR}: no metaData action in the checkpoint or the commits after it")
    return found


def app_transactions(table: LakeDir, latest: int) -> dict[str, AppTransaction]:
    """Every application transaction of the table as of version ``latest``: the newest checkpoint's,
    then the commits after it (a later txn of the same app replaces the earlier)."""
    checkpoint = last_checkpoint(table)
    if checkpoint is not None and checkpoint[0] > latest:
        # A version before the newest checkpoint: the newest one at or before it (the log's older commits may
        # be gone, cdcd/lake/maintenance/log_cleanup.py).
        checkpoint = checkpoint_at_or_before(table, latest)
    start = 0 if checkpoint is None else checkpoint[0] + 1
    txns: dict[str, AppTransaction] = {}
    for txn in _replay(table, "txn", checkpoint, range(start, latest + 1)):
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
