"""``cdcd lake sql``: a SQL query over the lake's cache tables, each a view under its cache name, all
read at one cut (the latest, or the newest at ``--as-of``), printed as a table, CSV or JSON.

DuckDB by default (in process, no JVM; the delta extension from its wheel); ``engine="spark"`` runs
the same query in a local or cluster SparkSession. A query that fails (unknown table, bad SQL) is one
line and exit 1; a lake without a recorded cut is one line and exit 1; a bad ``--as-of`` exit 2.

CSV and JSON stream every row in batches (memory bounded by the batch, not the result); the table
format needs all shown rows for its column widths, so it shows at most ``max_rows`` and says so.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import decimal
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from cdcd.lake.cuts import Cut, NoCut, cut_as_of, parse_time
from cdcd.lake.readers import LakeArg, duckdb_connect, open_lake, register_duckdb, register_spark, resolve_cut
from cdcd.lake.storage import LakeDir, ObjectPath, StorageOptions

ENGINES = ("duckdb", "spark")
FORMATS = ("table", "csv", "json")
MAX_TABLE_ROWS = 10_000
"""Rows the table format shows at most (``--max-rows``)."""
BATCH_ROWS = 10_000
"""Rows fetched at a time for CSV and JSON."""


class QueryFailed(RuntimeError):
    """The engine refused the query (one line: its own message, plus the tables there are)."""


@dataclass(frozen=True)
class Result:
    columns: list[str]
    rows: Iterator[Sequence[Any]]


def run_sql(
    lake: LakeArg,
    query: str,
    out: TextIO,
    err: TextIO,
    *,
    engine: str = "duckdb",
    fmt: str = "table",
    as_of: str | None = None,
    max_rows: int = MAX_TABLE_ROWS,
    spark_master: str = "local[*]",
    storage: StorageOptions | None = None,
) -> int:
    """Run ``query`` at the lake's latest cut (or the newest at ``as_of``), write the result to
    ``out`` and one-line errors to ``err``; returns the exit code (0 ok, 1 failed, 2 bad usage)."""
    if engine not in ENGINES or fmt not in FORMATS:
        err.write(f"--engine {engine!r} / --format {fmt!r}: choose from {ENGINES} and {FORMATS}\n")
        return 2
    try:
        when = parse_time(as_of) if as_of is not None else None
    except ValueError as exc:
        err.write(f"{exc}\n")
        return 2
    root = open_lake(lake, storage)
    try:
        cut = cut_as_of(root, when) if when is not None else resolve_cut(root, None)
    except NoCut as exc:
        err.write(f"{exc}\n")
        return 1
    if engine == "duckdb":
        opened = _duckdb_result(root, cut, query)
    else:
        # The table format shows max_rows at most: one more says whether there are more.
        opened = _spark_result(root, cut, query, master=spark_master, limit=max_rows + 1 if fmt == "table" else None)
    try:
        with opened as result:
            if result is not None:
                write_result(result, out, fmt, max_rows)
    except QueryFailed as exc:
        err.write(f"{exc}\n")
        return 1
    return 0


def lake_sql(lake: LakeArg, query: str, **options: Any) -> tuple[str, int]:
    """``run_sql`` into text: (stdout text, or the error line when the exit code is not 0; exit code)."""
    out, err = io.StringIO(), io.StringIO()
    code = run_sql(lake, query, out, err, **options)
    return (out.getvalue() if code == 0 else err.getvalue().rstrip("\n")), code


def _one_line(exc: BaseException, tables: Sequence[str]) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    low = text.lower()
    if "does not exist" in low or "not found" in low or "cannot be found" in low:
        text += f" (tables at this cut: {', '.join(tables) or 'none'})"
    return text


@contextmanager
def _duckdb_result(root: LakeDir, cut: Cut, query: str) -> Iterator[Result | None]:
    import duckdb

    con = duckdb_connect()
    try:
        views = register_duckdb(con, root, cut)
        try:
            rel = con.sql(query)
            if rel is None:
                yield None  # a statement with no result (SET, CREATE ...)
                return
            columns = list(rel.columns)

            def rows() -> Iterator[Sequence[Any]]:
                while batch := rel.fetchmany(BATCH_ROWS):
                    yield from batch

            yield Result(columns, rows())
        except duckdb.Error as exc:  # the query's, or raised while its rows are fetched
            raise QueryFailed(_one_line(exc, sorted(views))) from exc
    finally:
        con.close()


@contextmanager
def _spark_result(root: LakeDir, cut: Cut, query: str, *, master: str, limit: int | None) -> Iterator[Result | None]:
    from pyspark.errors import PySparkException

    from cdcd.lake import spark as spark_session

    conf = root.location.spark_conf if isinstance(root, ObjectPath) else {}
    spark = spark_session.acquire(master, "cdcd-lake-sql", conf)
    try:
        session = spark.newSession()  # its own temporary views, not the process's shared session's
        views = register_spark(session, root, cut)
        try:
            frame = session.sql(query)
            rows = frame.limit(limit).collect() if limit is not None else frame.toLocalIterator()
            yield Result(list(frame.columns), (tuple(r) for r in rows))
        except PySparkException as exc:
            raise QueryFailed(_one_line(exc, sorted(views))) from exc
    finally:
        spark_session.release()


# --- output -----------------------------------------------------------------------------------------


def write_result(result: Result, out: TextIO, fmt: str, max_rows: int = MAX_TABLE_ROWS) -> None:
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(result.columns)
        for row in result.rows:
            writer.writerow(["" if v is None else _text(v) for v in row])
    elif fmt == "json":
        # One JSON array of row objects, written row by row.
        out.write("[")
        for i, row in enumerate(result.rows):
            out.write(",\n" if i else "\n")
            out.write(json.dumps(dict(zip(result.columns, row, strict=True)), default=_json_value, ensure_ascii=False))
        out.write("\n]\n")
    else:
        _write_table(result, out, max_rows)


def _write_table(result: Result, out: TextIO, max_rows: int) -> None:
    from cdcd.lake.printable import printable

    shown: list[Sequence[Any]] = []
    more = False
    for row in result.rows:
        if len(shown) == max_rows:
            more = True
            break
        shown.append(row)
    header = [printable(c) for c in result.columns]
    cells = [["NULL" if v is None else printable(_text(v)) for v in row] for row in shown]
    numeric = [
        all(isinstance(row[i], int | float | decimal.Decimal) or row[i] is None for row in shown) and bool(shown)
        for i in range(len(header))
    ]
    widths = [max([len(header[i])] + [len(r[i]) for r in cells]) for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out.write(line(header) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in cells:
        out.write(line(r) + "\n")
    if more:
        out.write(f"(first {max_rows:,} rows shown: add a LIMIT or raise --max-rows)\n")
    else:
        out.write(f"({len(shown):,} row{'' if len(shown) == 1 else 's'})\n")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "asDict"):  # a Spark Row (a struct column): its fields by name
        return json.dumps(value.asDict(recursive=True), default=_json_value, ensure_ascii=False)
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, default=_json_value, ensure_ascii=False)
    return str(value)


def _json_value(value: Any) -> Any:
    """What json.dumps cannot write itself: decimals as numbers, times as ISO text, bytes as base64."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if hasattr(value, "asDict"):  # a Spark Row (struct column)
        return value.asDict(recursive=True)
    return _text(value)
