"""``cdcd lake sql``: a SQL query over the lake's cache tables, each a view under its cache name, all
read at one cut (the latest, or the newest at ``--as-of``), printed as a table, CSV or JSON.

DuckDB by default (in process, no JVM; the delta extension from its wheel); ``engine="spark"`` runs
the same query in a local or cluster SparkSession. Only a query runs: the engine's own parser decides
(DuckDB's statement types, Spark's parsed plan), and anything else (a write, DDL, ``COPY``,
``ATTACH``, ``SET``, ``CALL``, more than one statement ...) is refused, one line and exit 2, before
the engine runs it. DuckDB also opens no file outside the lake and its spill directory, and no
setting can change that. A query that fails (unknown table, bad SQL) is one line and exit 1; a lake
without a recorded cut is one line and exit 1; a path that is no lake, or a bad ``--as-of``, exit 2.

Output is spooled (in memory, then a temporary file) and written only once the result is complete,
so a query that fails half-way prints nothing but its error line. The table format needs all shown
rows for its column widths, so it shows at most ``max_rows`` and says so.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import decimal
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cdcd.faults import ExitCode, Fault
from cdcd.lake.cuts import Cut, NoCut, cut_as_of, parse_time
from cdcd.lake.reading.readers import (
    LakeArg,
    duckdb_connect,
    not_a_lake,
    open_lake,
    register_duckdb,
    register_spark,
    resolve_cut,
)
from cdcd.lake.storage import LakeDir, ObjectPath, StorageOptions

ENGINES = ("duckdb", "spark")
FORMATS = ("table", "csv", "json")
MAX_TABLE_ROWS = 10_000
"""Rows the table format shows at most (``--max-rows``)."""
BATCH_ROWS = 10_000
"""Rows fetched at a time for CSV and JSON."""
SPOOL_BYTES = 8 << 20
"""Output held in memory before the spool moves to a temporary file (``$TMPDIR``)."""

QUERY_KINDS = "SELECT, WITH, EXPLAIN, DESCRIBE or SHOW"


class QueryFailed(RuntimeError):
    """The engine refused the query (one line: its own message, plus the tables there are)."""


class NotAQuery(Fault, ValueError):
    """A statement ``lake sql`` does not run because it is not one read-only query: what it is."""

    exit_code = ExitCode.BAD_INPUT
    hint = f"lake sql runs one query ({QUERY_KINDS}) and changes nothing"

    def __init__(self, what: str) -> None:
        super().__init__(f"not a query: {what}")

    @property
    def line(self) -> str:
        return f"{self} ({self.hint})"


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
    if isinstance(root, Path):
        # Absolute and normalised: DuckDB's allowed_directories compare path prefixes.
        root = Path(os.path.abspath(root))
    missing = not_a_lake(root)
    if missing is not None:
        err.write(f"{missing} ({missing.hint})\n")
        return int(missing.exit_code)
    try:
        if engine == "duckdb":
            _duckdb_check(query)  # before the cut and the delta extension: a refusal costs nothing
        cut = cut_as_of(root, when) if when is not None else resolve_cut(root, None)
        if engine == "duckdb":
            opened = _duckdb_result(root, cut, query)
        else:
            # The table format shows max_rows at most: one more says whether there are more.
            limit = max_rows + 1 if fmt == "table" else None
            opened = _spark_result(root, cut, query, master=spark_master, limit=limit)
        with opened as result, _spool() as spool:
            write_result(result, spool, fmt, max_rows)
            spool.seek(0)
            shutil.copyfileobj(spool, out)
    except NotAQuery as exc:
        err.write(f"{exc.line}\n")
        return int(exc.exit_code)
    except (NoCut, QueryFailed) as exc:
        err.write(f"{exc}\n")
        return 1
    return 0


def _spool() -> Any:
    return tempfile.SpooledTemporaryFile(
        max_size=SPOOL_BYTES, mode="w+", encoding="utf-8", errors="surrogatepass", newline=""
    )


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


# --- only queries -----------------------------------------------------------------------------------

_DUCKDB_QUERY_WORDS = frozenset(
    {"select", "with", "from", "values", "table", "describe", "desc", "show", "summarize", "pivot", "unpivot", "("}
)
"""The words a DuckDB query may start with: a statement DuckDB parses as a SELECT but that starts
otherwise (``PRAGMA version`` is rewritten into one) is not run."""
_WORD = re.compile(r"\w+|\S")


def _first_words(text: str) -> list[tuple[int, str]]:
    """(offset, word) of each token of ``text``, comments left out (DuckDB's own tokenizer)."""
    import duckdb

    return [(at, m.group(0).lower()) for at, _ in duckdb.tokenize(text) if (m := _WORD.match(text, at))]


def duckdb_statement_check(con: Any, query: str, *, explained: bool = False) -> None:
    """NotAQuery unless DuckDB's parser finds exactly one statement in ``query`` and it reads: a
    SELECT (also ``WITH``, ``FROM``-first, ``VALUES``, ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``), or an
    EXPLAIN of one. ``WITH … DELETE`` is a DELETE to DuckDB, ``PRAGMA`` and ``CALL`` are refused."""
    import duckdb

    statements = con.extract_statements(query)
    if len(statements) != 1:
        raise NotAQuery("no statement" if not statements else f"{len(statements)} statements")
    kind = statements[0].type
    words = _first_words(query)
    first = words[0][1] if words else ""
    if kind == duckdb.StatementType.SELECT and first in _DUCKDB_QUERY_WORDS:
        return
    if kind == duckdb.StatementType.EXPLAIN and first == "explain" and not explained:
        i = 1
        if i < len(words) and words[i][1] in {"analyze", "analyse"}:
            i += 1
        if i < len(words) and words[i][1] == "(":  # EXPLAIN (FORMAT json) …
            depth = 0
            while i < len(words):
                depth += {"(": 1, ")": -1}.get(words[i][1], 0)
                i += 1
                if depth == 0:
                    break
        if i < len(words):
            duckdb_statement_check(con, query[words[i][0] :], explained=True)
            return
    named = first.upper() if first not in {"with", "(", ""} else kind.name
    raise NotAQuery(f"{named} statement")


def _duckdb_check(query: str) -> None:
    """``duckdb_statement_check`` in a connection of its own (no extension to load): QueryFailed for
    text DuckDB cannot parse."""
    import duckdb

    con = duckdb.connect()
    try:
        duckdb_statement_check(con, query)
    except duckdb.Error as exc:
        raise QueryFailed(_one_line(exc, [])) from exc
    finally:
        con.close()


@contextmanager
def _duckdb_result(root: LakeDir, cut: Cut, query: str) -> Iterator[Result]:
    import duckdb

    with tempfile.TemporaryDirectory(prefix="cdcd-lake-sql-") as spill:
        # Reads under the lake only (tables on an object store come in as Arrow datasets, no files).
        con = duckdb_connect(confine_to=[str(root)] if isinstance(root, Path) else [], temp_directory=spill)
        try:
            views: dict[str, str] = {}
            try:
                duckdb_statement_check(con, query)  # again: the connection that runs it parses it
                views = register_duckdb(con, root, cut)
                rel = con.sql(query)
                if rel is None:  # cannot be after the check, but never print nothing as a result
                    raise NotAQuery("a statement without a result")
                columns = list(rel.columns)

                def rows() -> Iterator[Sequence[Any]]:
                    while batch := rel.fetchmany(BATCH_ROWS):
                        yield from batch

                yield Result(columns, rows())
            except duckdb.Error as exc:  # the query's, or raised while its rows are fetched
                raise QueryFailed(_one_line(exc, sorted(views))) from exc
        finally:
            con.close()


_SPARK_QUERY_NODES = frozenset(
    {f"org.apache.spark.sql.catalyst.plans.logical.{name}" for name in (
        "Aggregate", "CTERelationDef", "CTERelationRef", "Deduplicate", "Distinct", "Except", "Expand",
        "Filter", "Generate", "GlobalLimit", "Intersect", "Join", "LateralJoin", "LimitAll", "LocalLimit",
        "LocalRelation", "Offset", "OneRowRelation", "Pivot", "Project", "Range", "RebalancePartitions",
        "Repartition", "RepartitionByExpression", "Sample", "Sort", "SubqueryAlias", "Tail", "Union",
        "UnionLoop", "UnionLoopRef", "Unpivot", "UnresolvedHint", "UnresolvedWith", "Window",
        "WithCTE", "WithWindowDefinition",
    )}
    | {f"org.apache.spark.sql.catalyst.analysis.{name}" for name in (
        "RelationTimeTravel", "UnresolvedHaving", "UnresolvedInlineTable", "UnresolvedQualify",
        "UnresolvedRelation", "UnresolvedSubqueryColumnAliases", "UnresolvedTVFAliases",
        "UnresolvedTableValuedFunction",
    )}
    | {"org.apache.spark.sql.catalyst.expressions.PipeOperator"}
)  # fmt: skip
"""The parsed-plan nodes a Spark query is built of; any other node (a command, an INSERT, a
``CALL``, ``EXECUTE IMMEDIATE`` ...) anywhere in the plan refuses it."""
_SPARK_READ_COMMANDS = frozenset(
    {f"org.apache.spark.sql.catalyst.plans.logical.{name}" for name in (
        "DescribeColumn", "DescribeFunction", "DescribeNamespace", "DescribeRelation", "ShowColumns",
        "ShowCreateTable", "ShowFunctions", "ShowNamespaces", "ShowTableProperties", "ShowTables",
        "ShowTablesExtended", "ShowViews",
    )}
)  # fmt: skip
"""DESCRIBE and SHOW: commands that only read the session's catalog."""
_SPARK_EXPLAIN = {
    "org.apache.spark.sql.execution.command.ExplainCommand": "logicalPlan",
    "org.apache.spark.sql.execution.command.DescribeQueryCommand": "plan",
}
"""EXPLAIN and DESCRIBE QUERY: fine when the plan they hold is a query."""
_SPARK_CALLERS = ("reflect", "java_method", "try_reflect")
"""Built-in functions that call any static Java method: dropped from the session ``lake sql`` runs in."""


def _spark_class(plan: Any) -> str:
    return str(plan.getClass().getName())


def _spark_named(name: str) -> str:
    return name.rsplit(".", 1)[-1].rstrip("$")


def spark_statement_check(session: Any, query: str) -> None:
    """NotAQuery unless Spark's parser makes one query of ``query`` (every node of its parsed plan,
    its CTEs and subqueries, one a query is built of), a DESCRIBE or SHOW, or an EXPLAIN of a query.
    Parsing executes nothing (``spark.sql`` would run a command at once)."""
    plan = session._jsparkSession.sessionState().sqlParser().parsePlan(query)
    top = _spark_class(plan)
    if top in _SPARK_READ_COMMANDS:
        return
    if top in _SPARK_EXPLAIN:
        plan = getattr(plan, _SPARK_EXPLAIN[top])()
    pending = [(plan, top in _SPARK_EXPLAIN)]
    while pending:
        node, inner = pending.pop()
        name = _spark_class(node)
        if name not in _SPARK_QUERY_NODES:
            raise NotAQuery(_spark_named(name) + (f" in {_spark_named(top)}" if inner else ""))
        for children in (node.children(), node.innerChildren(), node.subqueries()):
            pending.extend((children.apply(i), True) for i in range(children.size()))


def _drop_callers(session: Any) -> None:
    registry = session._jsparkSession.sessionState().functionRegistry()
    listed = registry.listFunction()
    for i in range(listed.size()):
        function = listed.apply(i)
        if function.funcName() in _SPARK_CALLERS:
            registry.dropFunction(function)


@contextmanager
def _spark_result(root: LakeDir, cut: Cut, query: str, *, master: str, limit: int | None) -> Iterator[Result]:
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    from cdcd.lake import spark as spark_session

    conf = root.location.spark_conf if isinstance(root, ObjectPath) else {}
    spark = spark_session.acquire(master, "cdcd-lake-sql", conf)
    try:
        session = spark.newSession()  # its own temporary views and functions, not the shared session's
        views: dict[str, str] = {}
        try:
            spark_statement_check(session, query)
            _drop_callers(session)
            views = register_spark(session, root, cut)
            frame = session.sql(query)
            rows = frame.limit(limit).collect() if limit is not None else frame.toLocalIterator()
            yield Result(list(frame.columns), (tuple(r) for r in rows))
        except (PySparkException, Py4JError) as exc:
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
