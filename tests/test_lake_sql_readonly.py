"""``cdcd lake sql`` reads and never writes (cdcd/lake/reading/sql.py, docs/lake.md "SQL by name"): on a lake that real
Spark compaction made (changes, state, typed tables, cuts), ``SELECT *`` works on every cache in every format and
through ``cdcd.lake.reading.readers`` (``_commit_ts`` is a timestamp with time zone: DuckDB hands it to Python through
pytz); every statement that is not one query is refused by the engine's own parser, one line and exit 2, on
DuckDB and on Spark; a list of write attempts on both engines changes no byte under the lake; DuckDB opens no file
outside it; and a query that fails half-way prints nothing but its error line."""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from cdcd.lake.reading.readers import duckdb_connect, quote_identifier, register_duckdb, view_names
from cdcd.lake.reading.sql import NotAQuery, duckdb_statement_check, lake_sql, spark_statement_check
from tests.support.delta_tables import append_changes, change, expected_state
from tests.support.lake import TEST_MASTER
from tests.support.procs import cdcd

RICH = {
    "sku": "A",
    "qty": 3,
    "price": 2.5,
    "ok": True,
    "tags": ["x", "y"],
    "dims": {"w": 1, "h": 2.5},
    "note": None,
    "text": 'é, "quoted"\nsecond line 😀',
}
"""One value of every JSON kind: the typed table gets string, bigint, double, boolean, array, struct columns."""
CACHES = ["orders", "Orders", "orders#2", "plain"]


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    version = 0
    for cache in CACHES:
        for k in range(4):
            version += 1
            value = {**RICH, "qty": k} if cache.lower().startswith("orders") else k * 10
            rows.append(change(cache, json.dumps(f"k{k}"), json.dumps(value), version))
    version += 1
    rows.append(change("orders", json.dumps("k3"), None, version))  # a delete: orders keeps 3 keys
    return rows


ROWS = _rows()
LIVE = {cache: sum(1 for c, _ in expected_state(ROWS) if c == cache) for cache in CACHES}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Path:
    """Changes landed by delta-rs as the sink lays them out, then one real compaction (state, a typed table
    per cache, a cut), in the worker's Spark session."""
    from cdcd.lake.maintenance.compact import compact

    root = tmp_path_factory.mktemp("sql-readonly") / "lake"
    append_changes(root, ROWS)
    compact(spark, root)
    return root


def files_under(root: Path) -> dict[str, str]:
    """Every directory and file under ``root``: path -> "dir" or the sha256 of its bytes."""
    out: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out[rel + "/"] = "dir"
        for name in files:
            out[os.path.join(rel, name)] = hashlib.sha256(Path(dirpath, name).read_bytes()).hexdigest()
    return out


def views() -> dict[str, str]:
    return view_names(CACHES)


# --- SELECT * everywhere ------------------------------------------------------------------------------


def test_select_star_on_every_cache_in_every_format(lake: Path) -> None:
    """Before: ``Required module 'pytz' failed to import`` on every cache (its ``_commit_ts``), after a csv
    header or a lone ``[`` had been printed."""
    for view, cache in views().items():
        query = f"SELECT * FROM {quote_identifier(view)}"
        text, code = lake_sql(lake, query, fmt="json")
        assert code == 0, text
        got = json.loads(text)
        assert len(got) == LIVE[cache]
        assert all(dt.datetime.fromisoformat(r["_commit_ts"]).tzinfo is not None for r in got)
        if cache not in {"orders", "plain"}:
            continue  # the other two formats on one table of each shape
        text, code = lake_sql(lake, query)
        assert code == 0, text
        assert text.splitlines()[-1] == f"({LIVE[cache]:,} rows)"
        text, code = lake_sql(lake, query, fmt="csv")
        assert code == 0, text
        table = list(csv.reader(io.StringIO(text)))
        assert len(table) == LIVE[cache] + 1 and "_commit_ts" in table[0]
    # The rich cache's values come back whole.
    text, _ = lake_sql(lake, 'SELECT * FROM orders WHERE "text" IS NOT NULL ORDER BY qty', fmt="json")
    first = json.loads(text)[0]
    assert {k: first[k] for k in RICH if k != "note"} == {k: v for k, v in {**RICH, "qty": 0}.items() if k != "note"}
    # changes and state by path too (their commit_ts is a timestamp with time zone as well).
    for name, rows in (("changes", len(ROWS)), ("state", sum(LIVE.values()))):
        text, code = lake_sql(lake, f"SELECT * FROM delta_scan('{lake / name}')", fmt="json")
        assert code == 0, text
        assert len(json.loads(text)) == rows


def test_select_star_through_the_command_in_every_format(lake: Path) -> None:
    """The command as a user runs it: exit 0, the whole result on stdout, nothing on stderr."""
    expected = LIVE["orders"]
    for fmt in ("table", "csv", "json"):
        res = cdcd("lake", "sql", "--lake", str(lake), "--format", fmt, "SELECT * FROM orders")
        assert (res.returncode, res.stderr) == (0, ""), res.stderr
        if fmt == "table":
            assert res.stdout.splitlines()[-1] == f"({expected} rows)"
        elif fmt == "csv":
            assert len(list(csv.reader(io.StringIO(res.stdout)))) == expected + 1
        else:
            assert len(json.loads(res.stdout)) == expected


def test_select_star_through_the_readers_fetchall(lake: Path) -> None:
    con = duckdb_connect()
    registered = register_duckdb(con, lake)
    assert registered == views()
    for view, cache in registered.items():
        rel = con.sql(f"SELECT * FROM {quote_identifier(view)}")
        rows = rel.fetchall()
        assert len(rows) == LIVE[cache]
        stamps = [r[rel.columns.index("_commit_ts")] for r in rows]
        assert all(isinstance(s, dt.datetime) and s.utcoffset() == dt.timedelta(0) for s in stamps)


# --- only queries -----------------------------------------------------------------------------------------

ALLOWED = [
    "SELECT count(*) AS n FROM orders",
    "  /* a comment */ -- and another\n select count(*) from orders;",
    "WITH o AS (SELECT * FROM orders) SELECT count(*) FROM o",
    "FROM orders SELECT count(*)",
    "VALUES (1), (2)",
    "(SELECT 1) UNION ALL (SELECT 2)",
    "DESCRIBE orders",
    "DESCRIBE SELECT * FROM orders",
    "SHOW TABLES",
    "SUMMARIZE orders",
    "PIVOT orders ON sku IN ('A') USING count(*)",
    "UNPIVOT (SELECT 1 AS a, 2 AS b) ON a, b INTO NAME k VALUE v",
    "EXPLAIN SELECT * FROM orders",
    "EXPLAIN ANALYZE SELECT count(*) FROM orders",
]


def test_queries_of_every_kind_pass_the_check_and_some_run(lake: Path) -> None:
    import duckdb

    con = duckdb.connect()
    for query in ALLOWED:
        duckdb_statement_check(con, query)
    for query in (ALLOWED[1], "DESCRIBE orders", "PIVOT orders ON sku IN ('A') USING count(*)", ALLOWED[-1]):
        text, code = lake_sql(lake, query, fmt="csv")
        assert code == 0, text


REFUSED = [
    ("SELECT 1; SELECT 2", "not a query: 2 statements"),
    ("", "not a query: no statement"),
    (" -- only a comment", "not a query: no statement"),
    ("WITH x AS (SELECT 1) DELETE FROM orders", "not a query: DELETE statement"),
    ("/* SELECT */ COPY (SELECT 1) TO 'x.csv'", "not a query: COPY statement"),
    ("ATTACH ':memory:' AS m", "not a query: ATTACH statement"),
    ("INSTALL httpfs", "not a query: INSTALL statement"),
    ("LOAD httpfs", "not a query: LOAD statement"),
    ("SET threads = 1", "not a query: SET statement"),
    ("RESET threads", "not a query: RESET statement"),
    ("PRAGMA version", "not a query: PRAGMA statement"),
    ("CALL pragma_version()", "not a query: CALL statement"),
    ("EXPORT DATABASE 'x'", "not a query: EXPORT statement"),
    ("CREATE TABLE t AS SELECT 1", "not a query: CREATE statement"),
    ("USE memory", "not a query: USE statement"),
    ("CHECKPOINT", "not a query: CHECKPOINT statement"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO 'x.csv'", "not a query: COPY statement"),
    ("PREPARE p AS SELECT 1", "not a query: PREPARE statement"),
]


@pytest.mark.parametrize(("query", "line"), REFUSED)
def test_anything_but_one_query_is_refused_in_one_line(lake: Path, query: str, line: str) -> None:
    text, code = lake_sql(lake, query)
    assert (text, code) == (f"{line} ({NotAQuery.hint})", 2)


def test_duckdb_opens_no_file_outside_the_lake(lake: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.csv"
    outside.write_text("a\n1\n")
    text, code = lake_sql(lake, f"SELECT * FROM read_csv('{outside}')")
    assert code == 1 and "\n" not in text
    assert text.startswith(f'Permission Error: Cannot access file "{outside}"')
    log = next((lake / "state" / "_delta_log").glob("*.json"))
    text, code = lake_sql(lake, f"SELECT count(*) AS n FROM read_text('{log}')", fmt="csv")
    assert (text, code) == ("n\n1\n", 0)


def test_output_is_written_only_once_the_result_is_complete(lake: Path) -> None:
    """A query that fails after its first rows: no csv header, no lone ``[``, no table, only the error line."""
    failing = "SELECT CASE WHEN n < 25000 THEN n ELSE error('boom at ' || n) END AS n FROM range(30000) t(n)"
    for fmt in ("table", "csv", "json"):
        out, err = io.StringIO(), io.StringIO()
        from cdcd.lake.reading.sql import run_sql

        assert run_sql(lake, failing, out, err, fmt=fmt) == 1
        assert out.getvalue() == ""
        assert err.getvalue().count("\n") == 1 and "boom at" in err.getvalue()
    res = cdcd("lake", "sql", "--lake", str(lake), "--format", "csv", failing)
    assert (res.returncode, res.stdout) == (1, "")
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("cdcd: error: ")


# --- no byte changes ---------------------------------------------------------------------------------------


def _duckdb_attempts(lake: Path) -> list[str]:
    live = next((lake / "changes").rglob("*.parquet"))
    state_log = lake / "state" / "_delta_log"
    next_commit = state_log / f"{len(list(state_log.glob('*.json'))):020d}.json"
    return [
        f"ATTACH '{lake}/x.db' AS x",
        f"COPY (SELECT * FROM orders) TO '{live}' (FORMAT parquet)",
        f"COPY (SELECT 1 AS a) TO '{lake}/changes/part-extra.parquet' (FORMAT parquet)",
        f"COPY (SELECT 1 AS a) TO '{next_commit}' (FORMAT json)",
        f"/* read */ COPY orders TO '{lake}/orders.csv'",
        f"SELECT 1; COPY (SELECT 1) TO '{lake}/y.csv'",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{lake}/z.csv'",
        f"EXPORT DATABASE '{lake}/export'",
        f"SELECT * FROM query('COPY (SELECT 1) TO ''{lake}/q.csv''')",
        "CREATE TABLE t AS SELECT * FROM orders",
        "INSERT INTO orders SELECT * FROM orders",
        "WITH o AS (SELECT 1) DELETE FROM orders",
        "UPDATE orders SET qty = 0",
        "DROP VIEW orders",
        "SET enable_external_access = true",
        "INSTALL httpfs",
    ]


def _spark_attempts(lake: Path) -> list[str]:
    state, changes = f"delta.`{lake}/state`", f"delta.`{lake}/changes`"
    return [
        f"DELETE FROM {state}",
        f"UPDATE {state} SET value = NULL",
        f"INSERT INTO {changes} SELECT * FROM {changes} LIMIT 1",
        f"WITH x AS (SELECT * FROM {state}) INSERT INTO {state} SELECT * FROM x",
        f"MERGE INTO {state} t USING {state} s ON false WHEN NOT MATCHED THEN INSERT *",
        f"OPTIMIZE {changes}",
        f"VACUUM {changes} RETAIN 0 HOURS",
        f"RESTORE TABLE {state} TO VERSION AS OF 0",
        f"CREATE TABLE x USING delta LOCATION '{lake}/x' AS SELECT 1 AS a",
        f"INSERT OVERWRITE DIRECTORY '{lake}/dir' USING parquet SELECT 1 AS a",
        f"EXECUTE IMMEDIATE 'DELETE FROM {state}'",
        f"EXPLAIN DELETE FROM {state}",
        f"SELECT 1; DELETE FROM {state}",
        "SELECT reflect('java.lang.System', 'setProperty', 'cdcd.lake.reading.sql', 'x')",
        "CREATE TEMP VIEW v AS SELECT 1",
        "CACHE TABLE orders",
        "SET spark.sql.shuffle.partitions = 1",
        "ADD JAR '/nonexistent.jar'",
        "CALL system.nothing()",
        f"DESCRIBE HISTORY {state}",
    ]


def test_write_attempts_change_no_byte_under_the_lake_on_either_engine(lake: Path, spark: Any) -> None:
    before = files_under(lake)
    outcomes: list[tuple[str, str, int, str]] = []
    for query in _duckdb_attempts(lake):
        text, code = lake_sql(lake, query)
        outcomes.append(("duckdb", query, code, text))
    for query in _spark_attempts(lake):
        text, code = lake_sql(lake, query, engine="spark", spark_master=TEST_MASTER)
        outcomes.append(("spark", query, code, text))
    # Two through the command itself: exit code and one `cdcd: error:` line, nothing on stdout.
    for query in _duckdb_attempts(lake)[:2]:
        res = cdcd("lake", "sql", "--lake", str(lake), query)
        outcomes.append(("cli", query, res.returncode, res.stderr.removesuffix("\n")))
        assert res.stdout == "" and res.stderr.startswith("cdcd: error: not a query: ")
    assert files_under(lake) == before
    ran = [(engine, query, text) for engine, query, code, text in outcomes if code == 0]
    assert ran == [], "every write attempt is refused"
    several = [(engine, query, text) for engine, query, _, text in outcomes if "\n" in text or not text]
    assert several == [], "each refusal is one line"
    refused = [o for o in outcomes if o[3].startswith(("not a query: ", "cdcd: error: not a query: "))]
    # All but the ones the engines refuse themselves (query() takes a SELECT only, a statement after a
    # statement is a Spark syntax error, reflect is no function in lake sql's Spark session).
    assert len(refused) == len(outcomes) - 3, [o for o in outcomes if o not in refused]


def test_spark_takes_every_kind_of_query(lake: Path, spark: Any) -> None:
    """Spark's parsed plans of queries pass the check (executing nothing), and lake sql runs a few."""
    session = spark.newSession()
    for query in [
        "SELECT a, count(*) FROM t JOIN u USING (a) WHERE b > 1 GROUP BY a HAVING count(*) > 1 ORDER BY a LIMIT 3",
        "WITH x AS (SELECT 1 a), y AS (SELECT * FROM x) SELECT * FROM y",
        "SELECT a, row_number() OVER w FROM t WINDOW w AS (PARTITION BY a ORDER BY b)",
        "SELECT * FROM t LATERAL VIEW explode(arr) e AS v",
        "SELECT * FROM range(10)",
        "SELECT * FROM t VERSION AS OF 1",
        "SELECT * FROM t PIVOT (sum(x) FOR y IN (1, 2))",
        "SELECT * FROM t UNPIVOT (v FOR k IN (a, b))",
        "SELECT /*+ REPARTITION(2) */ DISTINCT a FROM t TABLESAMPLE (10 PERCENT)",
        "SELECT * FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.a = t.a) AND a IN (SELECT a FROM u)",
        "SELECT a FROM t UNION ALL SELECT a FROM u INTERSECT SELECT a FROM v EXCEPT SELECT a FROM w",
        "VALUES (1), (2)",
        "TABLE t",
        "FROM t SELECT a",
        "SELECT * FROM t QUALIFY row_number() OVER (ORDER BY a) = 1",
        "SELECT * FROM t |> WHERE a > 1 |> AGGREGATE count(*)",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r",
        "DESCRIBE t",
        "DESCRIBE QUERY SELECT 1",
        "SHOW TABLES",
        "SHOW COLUMNS IN t",
        "EXPLAIN EXTENDED SELECT * FROM t",
    ]:
        spark_statement_check(session, query)
    with pytest.raises(NotAQuery, match=r"^not a query: DeleteFromTable in ExplainCommand$"):
        spark_statement_check(session, "EXPLAIN DELETE FROM t")
    for query, first in (("SELECT count(*) AS n FROM orders", "n"), ("DESCRIBE orders", "col_name")):
        text, code = lake_sql(lake, query, engine="spark", spark_master=TEST_MASTER, fmt="csv")
        assert code == 0, text
        assert text.splitlines()[0].startswith(first)
    text, code = lake_sql(lake, "SELECT * FROM orders", engine="spark", spark_master=TEST_MASTER, fmt="json")
    assert code == 0, text
    assert len(json.loads(text)) == LIVE["orders"]


@pytest.mark.timeout(300)  # a Spark driver of its own, on a machine shared with other work
def test_a_failing_spark_query_through_the_command_is_one_line(lake: Path) -> None:
    """pyspark logs a failed query as a JSON line of its own: the command prints only its error line."""
    res = cdcd(
        "lake", "sql", "--lake", str(lake), "--engine", "spark", "--spark-master", TEST_MASTER,
        "SELECT * FROM nope", timeout=240,
    )  # fmt: skip
    assert (res.returncode, res.stdout) == (1, "")
    (line,) = res.stderr.splitlines()
    assert line.startswith("cdcd: error: [TABLE_OR_VIEW_NOT_FOUND]")
    assert line.endswith("(tables at this cut: #orders, orders, orders##2, plain)")
