"""View names are injective (cdcd/lake/reading/readers.py ``view_names``, docs/lake.md "View names"): whatever the cache
names, no two caches get views an engine confuses, and each view reads its own cache's rows, in DuckDB (ASCII
case-insensitive) and Spark (Unicode case-insensitive). Before, with caches ``ORDERS``, ``Orders`` and ``orders``
one view was ``Orders#2``, so a cache literally named ``orders#2`` read Orders' rows, and a cache named
``a\\u0000b`` (six characters) read the cache ``a<NUL>b``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import write_deltalake
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.lake.cuts import record_cut, table_path
from cdcd.lake.reading.readers import (
    cache_of_view,
    duckdb_connect,
    escape_view_name,
    quote_identifier,
    register_duckdb,
    register_spark,
    view_names,
)
from cdcd.lake.reading.sql import lake_sql

COLLIDING = ["ORDERS", "Orders", "orders", "orders#2", "Orders#2", "a\0b", "a\\u0000b", "a#{0}b", "K", "\u212a", "k"]
"""The issue's collisions, and their neighbours: a name spelled like another's escape (``a#{0}b``), the Kelvin
sign (Spark lower-cases it to ``k``)."""


def test_the_collisions_of_the_issue_get_names_of_their_own() -> None:
    views = view_names(COLLIDING)
    assert views == {
        "#o#r#d#e#r#s": "ORDERS",
        "#orders": "Orders",
        "orders": "orders",
        "orders##2": "orders#2",
        "#orders##2": "Orders#2",
        "a#{0}b": "a\0b",
        "a\\u0000b": "a\\u0000b",
        "a##{0}b": "a#{0}b",
        "#k": "K",
        "#{212a}": "\u212a",
        "k": "k",
    }


def test_a_name_alone_is_its_own_view() -> None:
    """Only what needs it is escaped: capitals alone, dots, quotes, spaces and non-ASCII letters stay."""
    names = ["Orders", 'odd name.x "q" `b` = ;', "é" * 3, "заказы", "a\\u0000b"]
    assert view_names(names) == {name: name for name in names}


NAME_CHARS = st.sampled_from(
    [
        *"aAbB#{}02 .`\"'\\",
        *"\0\n\u212akK",  # NUL, newline, the Kelvin sign and what it folds to
        *"\u00df\u1e9e\u03a3\u03c3\u03c2\u0130i",  # sharp s (both cases), sigma (three forms), dotted capital I
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(NAME_CHARS, min_size=1, max_size=6), max_size=8, unique=True))
def test_views_never_collide_and_name_their_cache(caches: list[str]) -> None:
    views = view_names(caches)
    assert sorted(views.values()) == sorted(caches)
    # Distinct also ignoring case as each engine does: Spark lower-cases all of Unicode, DuckDB ASCII only.
    for fold in (str.lower, lambda v: "".join(c.lower() if c.isascii() else c for c in v)):
        assert len({fold(v) for v in views}) == len(views)
    for view, cache in views.items():
        assert cache_of_view(view) == cache
        assert cache_of_view(escape_view_name(cache)) == cache


@pytest.mark.parametrize("junk", ["a#", "#Z", "#{zz}", "#{110000}", "#{1", "#!"])
def test_text_no_view_can_be_is_refused(junk: str) -> None:
    with pytest.raises(ValueError, match="not a view name of a cache"):
        cache_of_view(junk)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One table per colliding cache, each holding one row: its own cache name; a cut naming them all."""
    root = tmp_path_factory.mktemp("views") / "lake"
    for cache in COLLIDING:
        write_deltalake(str(table_path(root, cache)), pa.table({"cache": [cache]}))
    record_cut(root, dict.fromkeys(COLLIDING, 0), {}, 0)
    return root


def test_each_duckdb_view_reads_its_own_cache(lake: Path) -> None:
    con = duckdb_connect()
    views = register_duckdb(con, lake)
    assert views == view_names(COLLIDING)
    for view, cache in views.items():
        assert con.sql(f"SELECT cache FROM {quote_identifier(view)}").fetchall() == [(cache,)]
    # Through lake sql as a user types it.
    assert lake_sql(lake, 'SELECT cache FROM "orders##2"', fmt="csv") == ("cache\norders#2\n", 0)
    assert lake_sql(lake, 'SELECT cache FROM "a\\u0000b"', fmt="csv") == ("cache\na\\u0000b\n", 0)


def test_each_spark_view_reads_its_own_cache(lake: Path, spark: Any) -> None:
    session = spark.newSession()
    views = register_spark(session, lake)
    assert views == view_names(COLLIDING)
    # One job, each view's rows beside the view's name; of the pairs DuckDB tells apart by itself the ones
    # Spark would fold together (case, the Kelvin sign) and the issue's two.
    read = {"#orders", "orders", "orders##2", "#{212a}", "k", "a#{0}b", "a\\u0000b"}
    query = " UNION ALL ".join(
        f"SELECT '{view.replace(chr(92), chr(92) * 2).replace(chr(39), chr(92) + chr(39))}' AS view, cache "
        f"FROM {quote_identifier(view, '`')}"
        for view in sorted(read)
    )
    assert sorted(tuple(r) for r in session.sql(query).collect()) == sorted((v, views[v]) for v in read)
