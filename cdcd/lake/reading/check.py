"""``cdcd lake check``: is every table of the lake whole? Read from the Delta logs and the files
they name, without a JVM; also run by ``lake verify`` and ``lake show``, and by the lake sink when
delta-rs fails to read a log (its errors name no file).

Per table (``changes``, ``state``):

- every commit file parses: each line one JSON object (a torn write or garbage does not);
- the log has no hole between the checkpoint it starts from and its newest commit;
- ``_last_checkpoint`` parses and names a checkpoint that is there;
- every checkpoint reads, and holds the files the commits up to it leave (when those commits are
  all still there to tell);
- every data file the log names as live exists with the size its add action records (a file
  overwritten or cut since its commit is named, though its footer may still read) and, unless asked
  not to, its Parquet footer reads and holds the row count the action's statistics record.

Each fault is one line: the file, what is wrong, what to do. ``DamagedLake`` carries the first one
(and the exit code of a damaged lake) for callers that stop on it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.faults import ExitCode
from cdcd.faults import Fault as ExitFault
from cdcd.lake.deltalog import LOG_DIR
from cdcd.lake.storage import LakeDir, ObjectPath, file_source
from cdcd.lake.table import CHANGES, CUTS, STATE, TABLES

EXIT_DAMAGED_LAKE = ExitCode.DAMAGED_LAKE
"""Exit code of a command or daemon that stopped on a damaged lake (docs/operations.md)."""

_COMMIT = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")
_LAST_CHECKPOINT = "_last_checkpoint"


@dataclass(frozen=True)
class Fault:
    path: str
    what: str
    hint: str

    @property
    def line(self) -> str:
        return f"{self.path}: {self.what}: {self.hint}"


class DamagedLake(ExitFault, Exception):
    """A lake whose log or files are damaged: ``str()`` is one line naming the file, what is wrong
    and what to do (``hint``); ``exit_code`` is the dedicated exit code."""

    exit_code = ExitCode.DAMAGED_LAKE
    hint: str = "run `cdcd lake check` for every fault"

    def __init__(self, path: str, what: str, hint: str = "") -> None:
        self.path = path
        self.what = what
        if hint:
            self.hint = hint
        super().__init__(f"{path}: {what}: {self.hint}")

    @classmethod
    def of(cls, faults: list[Fault]) -> DamagedLake:
        first = faults[0]
        more = f" ({len(faults) - 1} more fault(s): `cdcd lake check`)" if len(faults) > 1 else ""
        return cls(first.path, first.what, first.hint + more)


@dataclass
class TableCheck:
    table: str
    version: int = -1
    commits: int = 0
    files: int = 0
    faults: list[Fault] = field(default_factory=list)


def _log_names(log_dir: LakeDir) -> dict[str, LakeDir]:
    """The files directly in ``_delta_log`` by name."""
    if isinstance(log_dir, ObjectPath):
        return {p.name: p for p in log_dir.rglob("*") if p.rel.rsplit("/", 1)[0] == log_dir.rel}
    try:
        return {name: log_dir / name for name in os.listdir(log_dir)}
    except FileNotFoundError:
        return {}


def _parse_commit(path: LakeDir) -> tuple[list[dict[str, Any]] | None, str]:
    """The actions of a commit file, or None and what is wrong with it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    actions = []
    lines = data.split(b"\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            action = json.loads(line)
        except ValueError as exc:
            torn = lineno >= len(lines) - 1 and not data.endswith(b"\n")
            return None, f"line {lineno} is {'torn' if torn else 'not JSON'} ({exc})"
        if not isinstance(action, dict):
            return None, f"line {lineno} is not a JSON object"
        actions.append(action)
    if not actions:
        return None, "empty commit"
    return actions, ""


def _file_path(table: LakeDir, path: str) -> LakeDir:
    """The location of a data file as an add action names it (relative and percent-encoded, or a URI)."""
    parsed = urlparse(path)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    prefix = f"{table}/"
    if parsed.scheme and path.startswith(prefix):
        return table / unquote(path[len(prefix) :])
    if parsed.scheme:  # a file outside the table: Delta allows it, cdcd's writers never write one
        return Path(unquote(parsed.path)) if isinstance(table, Path) else table / unquote(path)
    return table / unquote(path)


@dataclass(frozen=True)
class _Added:
    """What the log records of a live data file: the version that added it, its size, its rows."""

    version: int
    size: int | None
    rows: int | None


def _added(version: int, add: dict[str, Any]) -> _Added:
    size = add.get("size")
    rows = None
    stats = add.get("stats")
    if isinstance(stats, str):
        try:
            parsed = json.loads(stats)
        except ValueError:
            parsed = None  # statistics are optional: unreadable ones only say nothing
        if isinstance(parsed, dict) and isinstance(parsed.get("numRecords"), int):
            rows = parsed["numRecords"]
    return _Added(version, size if isinstance(size, int) else None, rows)


def _read_checkpoint(files: list[LakeDir], version: int) -> dict[str, _Added]:
    """The live data files a checkpoint holds."""
    adds: dict[str, _Added] = {}
    for part in files:
        schema = pq.read_schema(file_source(part))
        if "add" not in schema.names:
            continue
        for row in pq.read_table(file_source(part), columns=["add"]).column("add").to_pylist():
            if row is not None:
                adds[row["path"]] = _added(version, row)
    return adds


def _apply(live: dict[str, _Added], version: int, actions: list[dict[str, Any]]) -> None:
    for action in actions:
        if (add := action.get("add")) is not None:
            live[add["path"]] = _added(version, add)
        elif (remove := action.get("remove")) is not None:
            live.pop(remove["path"], None)


def _size(path: LakeDir) -> int:
    """The size of a data file; FileNotFoundError when it is not there."""
    if isinstance(path, ObjectPath):
        import pyarrow.fs as pafs

        info = path.fs.get_file_info(path.fs_path)
        if info.type == pafs.FileType.NotFound or info.size is None:
            raise FileNotFoundError(str(path))
        return int(info.size)
    return os.stat(path).st_size


def check_table(table: LakeDir, *, read_files: bool = True) -> TableCheck:
    """Every check of the module on one Delta table (``read_files``: read each data file's footer,
    not only whether it is there)."""
    result = TableCheck(str(table))
    faults = result.faults
    log_dir = table / LOG_DIR
    names = _log_names(log_dir)
    commit_files = {int(m.group(1)): p for n, p in names.items() if (m := _COMMIT.match(n))}
    checkpoint_files: dict[int, list[LakeDir]] = {}
    for n, p in sorted(names.items()):
        if m := _CHECKPOINT.match(n):
            checkpoint_files.setdefault(int(m.group(1)), []).append(p)
    if not commit_files and not checkpoint_files:
        faults.append(Fault(str(log_dir), "holds no commit", "not a Delta table: restore the table from a backup"))
        return result
    latest = max([*commit_files, *checkpoint_files])
    result.version = latest

    actions: dict[int, list[dict[str, Any]]] = {}
    for version in sorted(commit_files):
        path = commit_files[version]
        parsed, what = _parse_commit(path)
        if parsed is None:
            hint = (
                "the newest commit, torn or overwritten: delete it if no reader has used it (the writer "
                "lands that batch again), else restore it from a backup"
                if version == latest
                else "restore it from a backup"
            )
            faults.append(Fault(str(path), what, hint))
        else:
            actions[version] = parsed
    result.commits = len(commit_files)

    def replayable(upto: int) -> bool:
        return all(v in actions for v in range(upto + 1))

    named: int | None = None
    pointer = names.get(_LAST_CHECKPOINT)
    if pointer is not None:
        drop = "delete it: readers then find the newest checkpoint by listing the log"
        try:
            info = json.loads(pointer.read_bytes())
            named = int(info["version"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            faults.append(Fault(str(pointer), f"not a checkpoint pointer ({type(exc).__name__}: {exc})", drop))
        else:
            if named not in checkpoint_files:
                faults.append(Fault(str(pointer), f"names checkpoint version {named}, which is not in the log", drop))
                named = None
            elif named > latest:
                faults.append(Fault(str(pointer), f"names version {named}, beyond the log's end {latest}", drop))
                named = None

    checkpoints: dict[int, dict[str, _Added]] = {}
    for version, files in sorted(checkpoint_files.items()):
        where = str(files[0])
        remedy = (
            "delete the checkpoint file(s) of this version (and _last_checkpoint if it names it): readers "
            "replay the commits instead"
            if replayable(version)
            else "restore it from a backup (the commits before it are gone)"
        )
        try:
            held = _read_checkpoint(files, version)
        except (OSError, pa.ArrowException, KeyError, TypeError) as exc:
            faults.append(Fault(where, f"unreadable checkpoint ({type(exc).__name__}: {exc})", remedy))
            continue
        if replayable(version):
            live: dict[str, _Added] = {}
            for v in range(version + 1):
                _apply(live, v, actions[v])
            if set(live) != set(held):
                faults.append(
                    Fault(
                        where,
                        f"holds {len(held)} live files where the commits up to version {version} leave "
                        f"{len(live)} ({len(set(held) - set(live))} extra, {len(set(live) - set(held))} missing)",
                        remedy,
                    )
                )
                continue
        checkpoints[version] = held

    # The live files of the newest version: from the checkpoint readers start at, then the commits.
    usable = [v for v in checkpoints if v <= latest]
    base = named if named in checkpoints else (max(usable) if usable else -1)
    live_files: dict[str, _Added] = dict(checkpoints.get(base, {}))
    for version in range(base + 1, latest + 1):
        if version in actions:
            _apply(live_files, version, actions[version])
        elif version not in commit_files:
            faults.append(
                Fault(
                    str(log_dir / f"{version:020d}.json"),
                    f"missing: the log has a hole between version {base + 1 if base >= 0 else 0} and {latest}",
                    "restore it from a backup",
                )
            )
    result.files = len(live_files)
    for rel, added in sorted(live_files.items()):
        path = _file_path(table, rel)
        version = added.version
        fix = (
            f"restore it from a backup; else drop it from the log (delta-rs: DeltaTable('{table}').repair()) "
            "and land its rows again (`cdcd resend`; `cdcd lake compact` for state)"
        )
        try:
            size = _size(path)
            if added.size is not None and size != added.size:
                what = (
                    f"{size:,} bytes where the log (version {version}) records {added.size:,}: "
                    "overwritten or cut since its commit"
                )
                faults.append(Fault(str(path), what, fix))
                continue
            if read_files:
                rows = pq.read_metadata(file_source(path)).num_rows
                if added.rows is not None and rows != added.rows:
                    what = f"{rows:,} rows where the log (version {version}) records {added.rows:,}: replaced since"
                    faults.append(Fault(str(path), what, fix))
        except FileNotFoundError:
            faults.append(Fault(str(path), f"named by the log (version {version}) but missing", fix))
        except (OSError, pa.ArrowException) as exc:
            faults.append(Fault(str(path), f"unreadable Parquet ({type(exc).__name__}: {exc})", fix))
    return result


def check_lake(lake: LakeDir, *, read_files: bool = True, every_table: bool = False) -> list[TableCheck]:
    """``check_table`` of ``changes`` and ``state`` where they have a log (none: an empty list);
    ``every_table`` (``cdcd lake check``): also ``_cuts`` and each typed table under ``tables/``.
    Those are left out of the checks that gate landing and compaction: one damaged typed table must
    not stop the others."""
    out = []
    tables = [lake / CHANGES, lake / STATE]
    if every_table:
        tables += [lake / CUTS, *_typed_tables(lake)]
    for table in tables:
        if (table / LOG_DIR).exists():
            out.append(check_table(table, read_files=read_files))
    return out


def _typed_tables(lake: LakeDir) -> list[LakeDir]:
    """The directories under ``<lake>/tables`` that have a Delta log, by name."""
    root = lake / TABLES
    if isinstance(root, ObjectPath):
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(root.fs_path, allow_not_found=True, recursive=False)
        names = [i.base_name for i in root.fs.get_file_info(selector) if i.type == pafs.FileType.Directory]
    else:
        try:
            names = [entry.name for entry in os.scandir(root) if entry.is_dir()]
        except FileNotFoundError:
            return []
    return [root / name for name in sorted(names) if (root / name / LOG_DIR).exists()]


def require_sound(lake: LakeDir, *, read_files: bool = False) -> None:
    """Raise DamagedLake (the first fault, and how many more) unless every table checks out."""
    faults = [f for t in check_lake(lake, read_files=read_files) for f in t.faults]
    if faults:
        raise DamagedLake.of(faults)


def damaged_table(table: LakeDir) -> DamagedLake | None:
    """What is wrong with one table's log or files, for a caller whose read failed without naming a
    file (delta-rs): the first fault, or None when the check finds none."""
    faults = check_table(table, read_files=False).faults
    return DamagedLake.of(faults) if faults else None


def report_lines(checks: list[TableCheck]) -> list[str]:
    """What ``cdcd lake check`` prints: one line per fault, then one summary line per table."""
    lines = [f.line for t in checks for f in t.faults]
    for t in checks:
        state = "ok" if not t.faults else f"{len(t.faults)} fault(s)"
        lines.append(f"{t.table}: version {t.version}, {t.commits} commit files, {t.files} live files: {state}")
    return lines
