"""Where the typed tables live and how their layout is kept in their own Delta metadata.

``<lake>/tables/<dir>``: one Delta table per cache; ``<dir>`` follows the ``cache=`` partitions' rule
(``partition_dir_value``) and the real cache name is the table property ``cdcd.cache``. Each column
carries a comment (JSON; Spark's ``DESCRIBE`` shows it, delta-rs has it in the field metadata): the
field it holds (``field``: the mapping from column names back to field names), the table version and
time it appeared (``since_version``, ``since``) and each time it widened (``widened``: a list of
``{"from", "to", "version", "at"}``, Spark SQL types); the key column says whether it holds JSON text, and
by which lattice the table was typed (``lattice``: absent in tables typed before anything widened).
So the table alone says how to read it back, and no other file can disagree with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from cdcd.faults import ExitCode, Fault
from cdcd.lake.landing.delta import partition_dir_value
from cdcd.lake.storage import LakeDir, ObjectPath, is_delta, open_delta
from cdcd.lake.table import COMMON_PROPERTIES, FOLDED_PROPERTIES, TABLES
from cdcd.lake.typed.infer import KEY, NON_DICT, Layout, base_columns

CACHE_PROPERTY = "cdcd.cache"
"""Table property holding the cache's real name (the directory name may be a prefix and a hash)."""

TABLE_PROPERTIES = {**COMMON_PROPERTIES, **FOLDED_PROPERTIES, "delta.enableChangeDataFeed": "true"}
"""No deletion vectors, no column mapping, classic checkpoints (every reader reads them) every 10 commits; the
change data feed on: ``readChangeFeed`` gives typed changes per cache."""


class NotATypedTable(Fault, ValueError):
    """A directory under ``<lake>/tables`` that is not one of cdcd's Delta tables."""

    exit_code = ExitCode.BAD_INPUT


def table_dir(lake: LakeDir, cache: str) -> LakeDir:
    return lake / TABLES / partition_dir_value(cache)


def _child_dirs(root: LakeDir) -> list[LakeDir]:
    if isinstance(root, ObjectPath):
        from pyarrow import fs as pafs

        if not root.exists():
            return []
        infos = root.fs.get_file_info(pafs.FileSelector(root.fs_path, recursive=False, allow_not_found=True))
        return [root / info.base_name for info in infos if info.type == pafs.FileType.Directory]
    if not root.is_dir():
        return []
    return [p for p in sorted(root.iterdir()) if p.is_dir()]


@dataclass(frozen=True)
class BadTable:
    """A typed table that cannot be opened (or, from compaction, merged): skipped, named in one line."""

    path: LakeDir
    cache: str | None
    """From the table's ``cdcd.cache`` property, read from its log when delta-rs cannot open it (None: unknown)."""
    error: str

    def line(self) -> str:
        from cdcd.lake.printable import printable

        name = "?" if self.cache is None else printable(self.cache)
        return f"{self.path}: typed table of cache {name} skipped: {printable(self.error)}"


@dataclass
class Tables:
    found: dict[str, LakeDir]
    """cache name -> its table (every one delta-rs opens)."""
    unreadable: list[BadTable]
    """Delta tables delta-rs cannot open (a schema it cannot parse, a damaged log)."""


def scan_tables(lake: LakeDir) -> Tables:
    """Every typed table: those delta-rs opens, and those it cannot (named, not raised: one bad table
    never stops the others). ``NotATypedTable`` (one line naming it) for a directory under ``tables/``
    that is not a Delta table, or whose ``cdcd.cache`` does not name it."""
    from cdcd.logging import describe

    found: dict[str, LakeDir] = {}
    unreadable: list[BadTable] = []
    for path in _child_dirs(lake / TABLES):
        if path.name.startswith("."):
            continue  # an editor's or a copy tool's hidden directory is not a table
        if not is_delta(path):
            raise NotATypedTable(
                f"{path}: not a Delta table (no _delta_log/); compaction stopped: move it out of {lake / TABLES}"
            )
        try:
            cache = open_delta(path).metadata().configuration.get(CACHE_PROPERTY)
        except Exception as exc:  # delta-rs cannot open it: reported with its cause, the others go on
            unreadable.append(BadTable(path, _cache_from_log(path), describe(exc)))
            continue
        if cache is None or partition_dir_value(cache) != path.name:
            raise NotATypedTable(
                f"{path}: a Delta table without a {CACHE_PROPERTY} property naming this directory "
                f"(found {cache!r}); compaction stopped: move it out of {lake / TABLES}"
            )
        found[cache] = path
    return Tables(found, unreadable)


def list_tables(lake: LakeDir) -> dict[str, LakeDir]:
    """cache name -> its table, for every table delta-rs opens (``scan_tables`` names the others);
    ``NotATypedTable`` as ``scan_tables``."""
    return scan_tables(lake).found


def _cache_from_log(path: LakeDir) -> str | None:
    """The ``cdcd.cache`` property of a table delta-rs cannot open, from the newest commit with a
    ``metaData`` action (its configuration is read, its schema is not parsed)."""
    from cdcd.lake.deltalog import LOG_DIR, read_commit

    log_dir = path / LOG_DIR
    try:
        versions = sorted(
            (int(p.name[:20]) for p in _files(log_dir) if p.name.endswith(".json") and p.name[:20].isdigit()),
            reverse=True,
        )
        for version in versions:
            for action in read_commit(path, version):
                meta = action.get("metaData")
                if isinstance(meta, dict):
                    cache = (meta.get("configuration") or {}).get(CACHE_PROPERTY)
                    return cache if isinstance(cache, str) and partition_dir_value(cache) == path.name else None
    except (OSError, ValueError):
        return None  # as unreadable as the rest: the path alone names it
    return None


def _files(root: LakeDir) -> list[LakeDir]:
    if isinstance(root, ObjectPath):
        from pyarrow import fs as pafs

        infos = root.fs.get_file_info(pafs.FileSelector(root.fs_path, recursive=False, allow_not_found=True))
        return [root / info.base_name for info in infos if info.type == pafs.FileType.File]
    return [p for p in root.iterdir() if p.is_file()] if root.is_dir() else []


# --- comments -------------------------------------------------------------------------------------------
def column_comment(field: str | None, since_version: int, *, json_text: bool = False) -> str:
    info: dict[str, Any] = {"since_version": since_version, "since": now_iso()}
    if field is None:
        info["value"] = True
    else:
        info["field"] = field
    if json_text:
        info["json"] = True
    return json.dumps(info, ensure_ascii=False)


LATTICE = 1
"""The key comment's ``lattice`` of a table typed by the widening lattice (``infer.join``); a table
without one (typed when nothing widened) may hold rescued values the lattice takes: restored once."""


def key_comment(key_json: bool, since_version: int, *, unset: bool = False) -> str:
    """The key column's comment: JSON text or typed (``unset``: no key seen yet, a table emptied by its
    cache's drop: the next keys' type is inferred afresh), and since which table version (a rebuild)."""
    kind = "unset" if unset else "json" if key_json else "typed"
    return json.dumps({"key": kind, "since_version": since_version, "since": now_iso(), "lattice": LATTICE})


def widened_comment(comment: Mapping[str, Any], old: pa.DataType, new: pa.DataType, version: int) -> str:
    """A column's comment with one more widening (from ``old`` to ``new`` at table ``version``) recorded."""
    step = {"from": spark_ddl_type(old), "to": spark_ddl_type(new), "version": version, "at": now_iso()}
    steps = comment.get("widened")
    return json.dumps({**comment, "widened": [*(steps if isinstance(steps, list) else []), step]}, ensure_ascii=False)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# --- Delta schema JSON <-> Arrow -------------------------------------------------------------------------
_DELTA_SCALARS: dict[str, pa.DataType] = {
    "string": pa.string(),
    "long": pa.int64(),
    "integer": pa.int32(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "binary": pa.binary(),
}


def arrow_type(delta_type: Any) -> pa.DataType:
    if isinstance(delta_type, str):
        return _DELTA_SCALARS[delta_type]
    kind = delta_type["type"]
    if kind == "array":
        return pa.list_(arrow_type(delta_type["elementType"]))
    if kind == "struct":
        return pa.struct([pa.field(f["name"], arrow_type(f["type"])) for f in delta_type["fields"]])
    raise ValueError(f"no Arrow type for Delta type {delta_type!r}")


@dataclass
class ColumnInfo:
    name: str
    type: pa.DataType
    comment: dict[str, Any]


def schema_info(table: Any) -> list[ColumnInfo]:
    """The columns of a delta-rs table with their parsed comments (``{}`` when none)."""
    out = []
    for f in json.loads(table.schema().to_json())["fields"]:
        raw = (f.get("metadata") or {}).get("comment")
        try:
            comment = json.loads(raw) if raw else {}
        except ValueError:
            comment = {}
        out.append(ColumnInfo(f["name"], arrow_type(f["type"]), comment if isinstance(comment, dict) else {}))
    return out


def read_layout(path: LakeDir) -> Layout:
    """The layout a typed table's schema and comments record."""
    columns = schema_info(open_delta(path))
    base = {f.name for f in base_columns(pa.string())}
    layout = Layout()
    json_fields = set()
    for c in columns:
        if c.name == KEY:
            layout.key_json = c.comment.get("key") == "json"
            layout.key_type = None if c.comment.get("key") == "unset" else c.type
        elif c.name in base:
            continue
        elif c.comment.get("value"):
            layout.columns[NON_DICT] = (c.name, c.type)
        else:
            name = c.comment.get("field", c.name)
            layout.columns[name] = (c.name, c.type)
            if c.comment.get("json"):
                json_fields.add(name)
    layout.json_fields = frozenset(json_fields)
    return layout


def spark_ddl_type(t: pa.DataType) -> str:
    """Spark SQL DDL of an Arrow type the typed tables use (names quoted: any plain field name)."""
    if pa.types.is_list(t):
        return f"ARRAY<{spark_ddl_type(t.value_type)}>"
    if pa.types.is_struct(t):
        return "STRUCT<" + ", ".join(f"{quote(f.name)}: {spark_ddl_type(f.type)}" for f in t) + ">"
    names = {
        pa.string(): "STRING",
        pa.int64(): "BIGINT",
        pa.int32(): "INT",
        pa.float64(): "DOUBLE",
        pa.bool_(): "BOOLEAN",
        pa.timestamp("us", tz="UTC"): "TIMESTAMP",
        pa.date32(): "DATE",
    }
    return names[t]


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def comments_for(layout: Layout, since_version: int, columns: list[str] | None = None) -> Mapping[str, str]:
    """column -> comment for ``columns`` (default all) of ``layout``."""
    wanted = None if columns is None else set(columns)
    unset = layout.key_type is None and not layout.key_json
    out: dict[str, str] = {KEY: key_comment(layout.key_json, since_version, unset=unset)}
    for name, (col, _) in layout.columns.items():
        if wanted is not None and col not in wanted:
            continue
        field = None if name == NON_DICT else name
        out[col] = column_comment(field, since_version, json_text=name in layout.json_fields)
    return out
