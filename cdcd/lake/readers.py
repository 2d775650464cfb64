"""Reading the lake: DuckDB's delta extension from its PyPI wheel, and every cache table at one cut
(cdcd/lake/cuts.py) as DuckDB views, Spark DataFrames or temporary views, or polars frames."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cdcd.lake.cuts import CUTS, Cut, NoCut, latest_cut, table_path
from cdcd.lake.printable import printable
from cdcd.lake.storage import LakeDir, ObjectPath, StorageOptions, lake_root, spark_path


def duckdb_delta_extension() -> Path:
    """The delta extension file the ``duckdb-extension-delta`` wheel ships for the installed duckdb."""
    import duckdb
    import duckdb_extension_delta

    version = duckdb.__version__
    path = Path(duckdb_extension_delta.__file__).parent / "extensions" / f"v{version}" / "delta.duckdb_extension"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: duckdb-extension-delta has no build for duckdb {version} (pin both equal)")
    return path


def duckdb_connect() -> Any:
    """An in-memory DuckDB connection with ``delta_scan`` loaded from the wheel, never from the network."""
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute("LOAD '" + str(duckdb_delta_extension()).replace("'", "''") + "'")
    return con


# --- the cache tables at one cut ------------------------------------------------------------------
# Every cache table is opened at the version one cut names (cdcd/lake/cuts.py), never at its own
# latest: tables a compaction commits one after another then agree on the source positions.


LakeArg = str | Path | ObjectPath
"""A lake: a directory, a URL (``s3://bucket/prefix`` ...), or a root from ``storage.lake_root``."""


def open_lake(lake: LakeArg, storage: StorageOptions | None = None) -> LakeDir:
    """The lake's root (a ``Path`` or an ``ObjectPath`` with its storage options)."""
    return lake if isinstance(lake, ObjectPath) else lake_root(str(lake), storage)


def resolve_cut(lake: LakeDir, cut: Cut | None) -> Cut:
    """``cut``, or the latest one; NoCut (one line) when no compaction recorded one yet."""
    if cut is not None:
        return cut
    latest = latest_cut(lake)
    if latest is None:
        raise NoCut(f"{lake / CUTS}: no cut recorded yet (run cdcd lake compact)")
    return latest


def view_names(caches: Iterable[str]) -> dict[str, str]:
    """View name -> cache name. DuckDB and Spark (by default) match names ignoring case, so of caches
    whose names differ only by case the first (in sorted order) keeps its name and each later one is
    ``<name>#2``, ``<name>#3`` ...: every table stays reachable and no view replaces another. No SQL
    identifier can hold a NUL: a name with one is named as ``printable`` writes it (``a\\u0000b``)."""
    views: dict[str, str] = {}
    taken: set[str] = set()
    for cache in sorted(caches):
        base = printable(cache) if "\0" in cache else cache
        name, n = base, 1
        while name.casefold() in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name.casefold())
        views[name] = cache
    return views


def quote_identifier(name: str, quote: str = '"') -> str:
    """``name`` as a quoted SQL identifier (DuckDB ``"…"``, Spark ``\\`…\\```): any name, doubled quotes."""
    return quote + name.replace(quote, quote * 2) + quote


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def register_duckdb(
    con: Any, lake: LakeArg, cut: Cut | None = None, *, storage: StorageOptions | None = None
) -> dict[str, str]:
    """Create a temporary view per cache table in the DuckDB connection ``con``, each at the version
    ``cut`` names (default: the latest cut). Returns view name -> cache name. ``con`` needs the delta
    extension loaded (``duckdb_connect()`` gives one) for a local lake; tables on an object store are
    read through delta-rs (Arrow datasets, with the lake's storage options)."""
    root = open_lake(lake, storage)
    chosen = resolve_cut(root, cut)
    views = view_names(chosen.tables)
    for i, (view, cache) in enumerate(views.items()):
        path, version = table_path(root, cache), chosen.tables[cache]
        if isinstance(path, ObjectPath):
            from deltalake import DeltaTable

            dataset = DeltaTable(str(path), version=version, storage_options=path.storage_options).to_pyarrow_dataset()
            # Registered under a private name, then a view under the cache's: both are temporary.
            source = f"__cdcd_cut_table_{i}"
            con.register(source, dataset)
            # Every name and path below is a quoted identifier or literal: no text is spliced in raw.
            body = f"SELECT * FROM {quote_identifier(source)}"  # noqa: S608
        else:
            body = f"SELECT * FROM delta_scan({_sql_string(str(path))}, version => {int(version)})"  # noqa: S608
        con.execute(f"CREATE OR REPLACE TEMP VIEW {quote_identifier(view)} AS {body}")
    return views


def spark_frames(
    spark: Any, lake: LakeArg, cut: Cut | None = None, *, storage: StorageOptions | None = None
) -> dict[str, Any]:
    """Cache name -> Spark DataFrame of its table at ``cut`` (default: the latest cut), ``versionAsOf``."""
    root = open_lake(lake, storage)
    chosen = resolve_cut(root, cut)
    return {
        cache: spark.read.format("delta").option("versionAsOf", version).load(spark_path(table_path(root, cache)))
        for cache, version in sorted(chosen.tables.items())
    }


def register_spark(
    spark: Any, lake: LakeArg, cut: Cut | None = None, *, storage: StorageOptions | None = None
) -> dict[str, str]:
    """Create a temporary view per cache table in ``spark`` (the user's session, with Delta on), each at
    the version ``cut`` names (default: the latest cut). Returns view name -> cache name; query them as
    ``spark.sql("SELECT … FROM `odd name`")``."""
    frames = spark_frames(spark, lake, cut, storage=storage)
    views = view_names(frames)
    for view, cache in views.items():
        frames[cache].createOrReplaceTempView(quote_identifier(view, "`"))
    return views


def polars_frames(
    lake: LakeArg, cut: Cut | None = None, *, lazy: bool = False, storage: StorageOptions | None = None
) -> dict[str, Any]:
    """Cache name -> polars DataFrame (``lazy``: LazyFrame) of its table at ``cut`` (default: the latest
    cut). ``pl.SQLContext(frames)`` queries them by name."""
    import polars as pl

    root = open_lake(lake, storage)
    chosen = resolve_cut(root, cut)
    frames: dict[str, Any] = {}
    for cache, version in sorted(chosen.tables.items()):
        path = table_path(root, cache)
        options = path.storage_options if isinstance(path, ObjectPath) else None
        read = pl.scan_delta if lazy else pl.read_delta
        frames[cache] = read(str(path), version=version, storage_options=options)
    return frames
