"""``cdcd lake show``'s part on the typed tables: per cache its table's version, rows, rows holding
rescued fields, and its schema with the field each column holds, when it appeared and when it widened. From the Delta
logs and the files' statistics only (no JVM, no data read)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from dataclasses import field as dc_field
from typing import Any

import click
import pyarrow as pa

from cdcd.lake.storage import LakeDir, open_delta
from cdcd.lake.typed.infer import RESCUED
from cdcd.lake.typed.layout import scan_tables, schema_info, spark_ddl_type


@dataclass
class ColumnShow:
    column: str
    type: str
    """Spark SQL type."""
    field: str | None
    """The value's field it holds (None: the key, a metadata column, or the non-dict ``value``)."""
    since_version: int | None
    since: str | None
    widened: list[dict[str, Any]] = dc_field(default_factory=list)
    """Each widening of the column, oldest first: ``from`` and ``to`` (Spark SQL types), the table
    ``version`` that rewrote it, and when (``at``)."""


@dataclass
class TableShow:
    cache: str
    path: str
    version: int
    rows: int
    rescued_rows: int
    """Rows whose ``_rescued`` holds something (from the files' null counts)."""
    key: str
    """``typed`` or ``json`` (JSON text: the cache held keys of more than one type)."""
    columns: list[ColumnShow] = field(default_factory=list)
    error: str | None = None
    """Why delta-rs cannot open it (version -1, ``key`` ``unreadable``); None for a table it reads."""


def tables_show(lake: LakeDir) -> list[TableShow]:
    """Every typed table of the lake (``NotATypedTable`` for a directory that is not one)."""
    out = []
    scan = scan_tables(lake)
    for bad in scan.unreadable:
        out.append(TableShow(bad.cache or "?", str(bad.path), -1, 0, 0, "unreadable", error=bad.error))
    for cache, path in sorted(scan.found.items()):
        table = open_delta(path)
        adds = pa.table(table.get_add_actions(flatten=True))
        rows = _sum(adds, "num_records")
        rescued = rows - _sum(adds, f"null_count.{RESCUED}") if adds.num_rows else 0
        columns = []
        key = "typed"
        for c in schema_info(table):
            if c.name == "key":
                key = str(c.comment.get("key", "typed"))
            columns.append(
                ColumnShow(
                    c.name,
                    spark_ddl_type(c.type),
                    c.comment.get("field"),
                    c.comment.get("since_version"),
                    c.comment.get("since"),
                    _widenings(c.comment.get("widened")),
                )
            )
        out.append(TableShow(cache, str(path), int(table.version()), rows, rescued, key, columns))
    return out


def _widenings(steps: object) -> list[dict[str, Any]]:
    return [dict(step) for step in steps if isinstance(step, dict)] if isinstance(steps, list) else []


def _sum(adds: pa.Table, column: str) -> int:
    if column not in adds.column_names:
        return 0
    return int(sum(v for v in adds.column(column).to_pylist() if v is not None))


def tables_json(shows: list[TableShow]) -> list[dict[str, Any]]:
    return [asdict(s) for s in shows]


def print_tables(shows: list[TableShow]) -> None:
    """The human form: one line per table, then its columns (type, field, since when)."""
    from cdcd.lake.printable import printable

    if not shows:
        return
    click.echo()  # a section of its own after lake show's per-cache rows
    click.echo(f"{'typed table':<24} {'version':>8} {'rows':>12} {'rescued rows':>13}  key")
    for s in shows:
        click.echo(f"{printable(s.cache):<24} {s.version:>8} {s.rows:>12,} {s.rescued_rows:>13,}  {s.key}")
    for s in shows:
        if s.error is not None:
            click.echo(f"table {printable(s.cache)} ({s.path}): unreadable, skipped: {printable(s.error)}")
            continue
        click.echo(f"table {printable(s.cache)} ({s.path}):")
        for c in s.columns:
            since = "since creation" if c.since_version in (None, 0) else f"since version {c.since_version}"
            when = f" ({c.since})" if c.since else ""
            holds = f"  field {printable(c.field)!s}" if c.field is not None and c.field != c.column else ""
            click.echo(f"  {printable(c.column):<24} {c.type:<20} {since}{when}{holds}")
            for step in c.widened:
                at = f" ({printable(str(step.get('at')))})" if step.get("at") else ""
                click.echo(
                    f"  {'':<24} {'':<20} widened {printable(str(step.get('from')))} -> "
                    f"{printable(str(step.get('to')))} at version {step.get('version')}{at}"
                )
