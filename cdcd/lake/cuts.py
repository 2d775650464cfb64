"""Consistent cuts across the lake's cache tables: which version of each table belongs together.

Delta has no multi-table commit: one compaction commits ``<lake>/tables/<orders>`` and then
``<lake>/tables/<accounts>``, and a reader that opens each table at its latest version can see the
first ahead of the second (half of a node transaction that wrote both caches). Every compaction
brings every table it touches to the same source positions (the changes-table version it read up
to), so after its last table commit it records a **cut**: that changes version, each source node's
WAL position at it, and the version of every cache table (those it did not touch at the version the
previous cut named). Reading every table at one cut's versions gives one consistent snapshot.

Cuts live in a small Delta table, ``<lake>/_cuts``, one row per cut, appended by delta-rs (its
commit is a put-if-absent of the next log file, locally and on object stores), so any Delta reader
can query it and ``cdcd lake cut`` needs no JVM::

    recorded_at      timestamp (UTC)        when the cut was recorded (after its last table commit)
    changes_version  bigint                 the changes-table version every table reflects
    tables           map<string, bigint>    cache name -> version of its table
    positions        map<string, string>    source node (``node`` or ``node:g<n>``) -> WAL position ``segment:offset``

The latest cut is the one with the highest ``changes_version`` (then the latest ``recorded_at``): a
compaction that lost a race and records an older cut after a newer one changes nothing. A cut names
table versions, so it can be read as long as those versions are (``lake vacuum`` horizon).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from cdcd import formats
from cdcd.lake.storage import LakeDir, ObjectPath, as_location_arg, is_delta, lake_root, open_delta
from cdcd.lake.table import COMMON_PROPERTIES, CUTS, SOURCE_APP_PREFIX

log = structlog.get_logger("cdcd.lake")


FORMAT_KEY = "cdcd.format"
"""The format version of ``_cuts`` (``cdcd.formats.LAKE_CUTS``; absent: 1, as v0.1.0 created it), in the
metadata of its ``changes_version`` column: set when the table is created, kept by every append (delta-rs
refuses a table property it does not know, and setting one later would be a commit of its own)."""

CUTS_SCHEMA = pa.schema(
    [
        ("recorded_at", pa.timestamp("us", tz="UTC")),
        pa.field("changes_version", pa.int64(), metadata={FORMAT_KEY: str(formats.LAKE_CUTS.current)}),
        ("tables", pa.map_(pa.string(), pa.int64())),
        ("positions", pa.map_(pa.string(), pa.string())),
    ]
)
CUTS_PROPERTIES = {**COMMON_PROPERTIES, "delta.appendOnly": "true"}

COMPACT_FILES = 64
"""``_cuts`` files (one per cut) at which ``record_cut`` bin-packs them into one: reading the latest cut
replays the table's file list, which must not grow with every compaction ever run."""

_CREATE_ATTEMPTS = 3
"""Two compactions creating ``_cuts`` at once: the loser of the put-if-absent appends to the winner's table."""


class NoCut(LookupError):
    """No cut recorded (at all, or at or before the time asked for): one line saying which."""


@dataclass(frozen=True)
class Cut:
    changes_version: int
    """The changes-table version every cache table of the cut reflects."""
    recorded_at: dt.datetime
    tables: Mapping[str, int] = field(default_factory=dict)
    """Cache name -> version of ``<lake>/tables/<dir>`` at this cut."""
    positions: Mapping[str, str] = field(default_factory=dict)
    """Source node -> WAL position (``segment:offset`` of the last record landed) at this cut."""

    def to_json(self) -> dict[str, Any]:
        return {
            "changes_version": self.changes_version,
            "recorded_at": self.recorded_at.isoformat(),
            "tables": dict(sorted(self.tables.items())),
            "positions": dict(sorted(self.positions.items())),
        }


def table_path(lake: LakeDir, cache: str) -> LakeDir:
    """Where the typed table of ``cache`` lives (``<lake>/tables/<dir>``)."""
    from cdcd.lake.typed.layout import table_dir

    return table_dir(lake, cache)


def source_positions(lake: LakeDir, changes_version: int) -> dict[str, str]:
    """Per source node (and generation), the WAL position the changes table holds up to at
    ``changes_version``: its application transactions, decoded."""
    from cdcd.lake.deltalog import app_transactions
    from cdcd.lake.landing.delta import decode_version
    from cdcd.lake.table import CHANGES

    if changes_version < 0:
        return {}
    out: dict[str, str] = {}
    for app, txn in app_transactions(lake / CHANGES, changes_version).items():
        if app.startswith(SOURCE_APP_PREFIX) and not app.endswith(":first"):
            out[app[len(SOURCE_APP_PREFIX) :]] = str(decode_version(txn.version))
    return out


def record_cut(
    lake: LakeDir,
    tables: Mapping[str, int],
    positions: Mapping[str, str],
    changes_version: int,
    *,
    now: dt.datetime | None = None,
    drop: Collection[str] = (),
) -> Cut:
    """Append the cut a compaction reached: ``tables`` are the versions it committed (or found) per
    cache; caches it did not name keep the version the latest cut has, but for ``drop`` (tables the
    compaction could not bring to ``changes_version``: no version of theirs belongs to this cut). A cut
    older than the latest (a compaction that lost a race) is not recorded: the latest is returned."""
    from deltalake import write_deltalake
    from deltalake.exceptions import CommitFailedError

    previous = latest_cut(lake)
    if previous is not None and changes_version < previous.changes_version:
        log.info("lake_cut_superseded", changes_version=changes_version, latest=previous.changes_version)
        return previous
    merged = dict(previous.tables) if previous is not None else {}
    merged.update(tables)
    for cache in drop:
        merged.pop(cache, None)
    recorded_at = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    cut = Cut(changes_version, recorded_at, dict(sorted(merged.items())), dict(sorted(positions.items())))
    row = pa.Table.from_pylist(
        [
            {
                "recorded_at": recorded_at,
                "changes_version": changes_version,
                "tables": list(cut.tables.items()),
                "positions": list(cut.positions.items()),
            }
        ],
        schema=CUTS_SCHEMA,
    )
    uri, options = as_location_arg(lake / CUTS)
    for attempt in range(1, _CREATE_ATTEMPTS + 1):
        try:
            write_deltalake(uri, row, mode="append", storage_options=options, configuration=CUTS_PROPERTIES)
            break
        except CommitFailedError:
            # Only the creation can conflict (appends commit at the next free version).
            if attempt == _CREATE_ATTEMPTS:
                raise
    log.info("lake_cut_recorded", changes_version=changes_version, tables=len(cut.tables))
    _keep_small(lake / CUTS)
    return cut


def check_format(table: Any, path: LakeDir) -> int:
    """The format version of the ``_cuts`` table ``table`` (at ``path``); FormatTooNew for a newer one."""
    raw = next((f.metadata.get(FORMAT_KEY) for f in table.schema().fields if f.name == "changes_version"), None)
    try:
        found = None if raw is None else formats.parse_version(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: column changes_version, metadata {FORMAT_KEY}: {exc}") from None
    return formats.check(formats.LAKE_CUTS, found, str(path))


def _keep_small(path: LakeDir) -> None:
    """Bin-pack ``_cuts`` once it holds COMPACT_FILES files (no data change: readers, old versions and
    a concurrent append are unaffected), and delete the replaced files older than the table's own retention
    (``delta.deletedFileRetentionDuration``: Delta's week, or ``vacuum_retain_hours`` once the sink's vacuum set it,
    cdcd/lake/maintenance/vacuum_rs.py). Full mode: a file whose tombstone a checkpoint already dropped (at that same
    age) is judged by its modification time instead of staying for ever."""
    table = open_delta(path)
    if len(table.file_uris()) < COMPACT_FILES:
        return
    table.optimize.compact()
    table.vacuum(dry_run=False, full=True)


def _read(lake: LakeDir, where: Any) -> list[Cut]:
    path = lake / CUTS
    if not is_delta(path):
        return []
    delta = open_delta(path)
    check_format(delta, path)
    if isinstance(path, ObjectPath):
        dataset = delta.to_pyarrow_dataset()
    else:
        # Locally pyarrow reads the live files itself: delta-rs's dataset (its file system handler on arrow's I/O
        # threads) now and then aborted the interpreter at exit ("terminate called without an active exception"),
        # so a `cdcd lake cut` that had printed its answer exited 134.
        import pyarrow.dataset as ds

        files = delta.file_uris()
        if not files:
            return []
        dataset = ds.dataset(files, format="parquet")
    # The files' statistics (min/max per column) let the dataset skip every file the filter excludes.
    table = dataset.to_table(filter=where)
    return [_cut(row) for row in table.to_pylist()]


def _cut(row: dict[str, Any]) -> Cut:
    return Cut(
        int(row["changes_version"]),
        row["recorded_at"].astimezone(dt.UTC),
        {k: int(v) for k, v in row["tables"]},
        {k: str(v) for k, v in row["positions"]},
    )


def _newest(cuts: list[Cut]) -> Cut | None:
    return max(cuts, key=lambda c: (c.changes_version, c.recorded_at), default=None)


def _max_changes_version(lake: LakeDir) -> int | None:
    """The highest ``changes_version`` of any cut, from the log's file statistics (no data file read)."""
    path = lake / CUTS
    if not is_delta(path):
        return None
    delta = open_delta(path)
    check_format(delta, path)
    actions = pa.table(delta.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return None
    column = "max.changes_version"
    if column not in actions.column_names:
        return -1  # files without statistics: read them all
    value = pc.max(actions[column]).as_py()
    return -1 if value is None else int(value)


def _root(lake: LakeDir | str | os.PathLike[str]) -> LakeDir:
    """A lake given as a string or ``os.PathLike`` (a directory or an object-store URL, as the readers take
    it) as its root."""
    return lake if isinstance(lake, Path | ObjectPath) else lake_root(os.fspath(lake))


def latest_cut(lake: LakeDir | str | os.PathLike[str]) -> Cut | None:
    """The newest cut (highest changes version), or None when no compaction recorded one."""
    lake = _root(lake)
    top = _max_changes_version(lake)
    if top is None:
        return None
    return _newest(_read(lake, pc.field("changes_version") >= top))


def cut_as_of(lake: LakeDir | str | os.PathLike[str], time: dt.datetime) -> Cut:
    """The newest cut recorded at or before ``time`` (naive: UTC); NoCut when there is none."""
    lake = _root(lake)
    when = time if time.tzinfo is not None else time.replace(tzinfo=dt.UTC)
    cut = _newest(_read(lake, pc.field("recorded_at") <= pa.scalar(when, pa.timestamp("us", tz="UTC"))))
    if cut is None:
        raise NoCut(f"{lake / CUTS}: no cut recorded at or before {when.isoformat()}")
    return cut


def parse_time(text: str) -> dt.datetime:
    """``--as-of``: an ISO 8601 time (``2026-11-26T08:40:00``, ``…Z``, ``…+01:00``; no zone: UTC)."""
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--as-of {text!r}: not an ISO 8601 time (e.g. 2026-11-26T08:40:00Z)") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def format_cut(cut: Cut) -> str:
    """The text ``cdcd lake cut`` prints: the cut's changes version and time, each table's version,
    each source's position (names escaped so one stays one line)."""
    from cdcd.lake.printable import printable

    lines = [f"cut at changes version {cut.changes_version}, recorded {cut.recorded_at.isoformat()}"]
    width = max([len(printable(name)) for name in cut.tables] + [len("table")])
    lines.append(f"{'table':<{width}} {'version':>8}")
    lines += [f"{printable(name):<{width}} {version:>8}" for name, version in sorted(cut.tables.items())]
    width = max([len(printable(name)) for name in cut.positions] + [len("source")])
    lines.append(f"{'source':<{width}} position")
    lines += [f"{printable(name):<{width}} {pos}" for name, pos in sorted(cut.positions.items())]
    return "\n".join(lines)


def cut_command(lake: LakeDir, *, as_of: str | None = None, as_json: bool = False) -> tuple[str, int]:
    """``cdcd lake cut --lake L [--latest | --as-of TIME] [--json]``: (text, exit code). Exit 0: the
    cut, for stdout; 1: no such cut, 2: an unparsable time, 10: ``_cuts`` of a newer format, each one
    line for stderr."""
    try:
        when = parse_time(as_of) if as_of is not None else None
    except ValueError as exc:
        return str(exc), 2
    try:
        cut = cut_as_of(lake, when) if when is not None else latest_cut(lake)
    except NoCut as exc:
        return str(exc), 1
    except formats.FormatTooNew as exc:
        return f"{exc} ({exc.hint})", exc.exit_code
    if cut is None:
        return f"{lake / CUTS}: no cut recorded yet (run cdcd lake compact)", 1
    return (json.dumps(cut.to_json(), ensure_ascii=False) if as_json else format_cut(cut)), 0
