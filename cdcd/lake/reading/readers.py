"""Reading the lake: DuckDB's delta extension from its PyPI wheel, and every cache table at one cut
(cdcd/lake/cuts.py) as DuckDB views, Spark DataFrames or temporary views, or polars frames."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from cdcd.faults import ExitCode, Fault
from cdcd.lake.cuts import Cut, NoCut, latest_cut, table_path
from cdcd.lake.deltalog import LOG_DIR
from cdcd.lake.printable import printable
from cdcd.lake.storage import LakeDir, ObjectPath, StorageOptions, lake_root, spark_path
from cdcd.lake.table import CHANGES, CUTS, STATE


def duckdb_delta_extension() -> Path:
    """The delta extension file the ``duckdb-extension-delta`` wheel ships for the installed duckdb."""
    import duckdb
    import duckdb_extension_delta

    version = duckdb.__version__
    path = Path(duckdb_extension_delta.__file__).parent / "extensions" / f"v{version}" / "delta.duckdb_extension"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: duckdb-extension-delta has no build for duckdb {version} (pin both equal)")
    return path


def duckdb_connect(*, confine_to: Sequence[str] | None = None, temp_directory: str | None = None) -> Any:
    """An in-memory DuckDB connection with ``delta_scan`` loaded from the wheel, never from the network.

    ``confine_to`` (``cdcd lake sql``): the directories the connection may open files under, and no
    other file, URL, extension or setting change: DuckDB's ``enable_external_access`` off with these
    ``allowed_directories``, then ``lock_configuration``, so no statement can undo either.
    ``temp_directory`` is where DuckDB spills (an in-memory database's default is ``.tmp`` in the
    working directory, which may be the lake)."""
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute("LOAD " + _sql_string(str(duckdb_delta_extension())))
    if temp_directory is not None:
        con.execute("SET temp_directory = " + _sql_string(temp_directory))
    if confine_to is not None:
        allowed = [d.rstrip("/") + "/" for d in confine_to]
        if temp_directory is not None:
            allowed.append(temp_directory.rstrip("/") + "/")
        con.execute("SET allowed_directories = [" + ", ".join(_sql_string(d) for d in allowed) + "]")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


# --- the cache tables at one cut ------------------------------------------------------------------
# Every cache table is opened at the version one cut names (cdcd/lake/cuts.py), never at its own
# latest: tables a compaction commits one after another then agree on the source positions.


LakeArg = str | Path | ObjectPath
"""A lake: a directory, a URL (``s3://bucket/prefix`` ...), or a root from ``storage.lake_root``."""


def open_lake(lake: LakeArg, storage: StorageOptions | None = None) -> LakeDir:
    """The lake's root (a ``Path`` or an ``ObjectPath`` with its storage options)."""
    return lake if isinstance(lake, ObjectPath) else lake_root(str(lake), storage)


class NotALake(Fault, NoCut):
    """A path that holds none of a lake's Delta tables (a parent of a lake, a table inside one, a file):
    the message names it, the hint says where the lake is when it is close by."""

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, message: str, hint: str) -> None:
        self.hint = hint
        super().__init__(message)


LAKE_TABLES = (CHANGES, STATE, CUTS)
"""The Delta tables of which a lake holds at least one (``changes`` from its first batch on)."""
_NEAR_DEPTH = 3
"""How many directories up and down ``not_a_lake`` looks for the lake a path misses."""


def is_lake(root: LakeDir) -> bool:
    """Whether ``root`` holds a lake: one of ``changes``, ``state``, ``_cuts`` with a Delta log."""
    return any((root / name / LOG_DIR).exists() for name in LAKE_TABLES)


def _lake_here(path: Path) -> bool:
    try:
        return is_lake(path)
    except OSError:  # a directory this user may not read is no hint, not an error
        return False


def _near_lake(path: Path) -> Path | None:
    """The lake a local path is in (an ancestor) or holds (a directory a few levels down), if any."""
    for parent in list(path.parents)[:_NEAR_DEPTH]:
        if _lake_here(parent):
            return parent
    level = [path] if path.is_dir() else []
    for _ in range(_NEAR_DEPTH):
        below: list[Path] = []
        for directory in level:
            try:
                children = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for child in children:
                if _lake_here(child):
                    return child
            below.extend(children)
        level = below[:200]  # a lake is near the path given, not anywhere in a large tree
    return None


def not_a_lake(root: LakeDir) -> NotALake | None:
    """None when ``root`` is a lake, else the one-line error: what it is not, where the lake is if it
    is close by (``--lake var`` for ``var/lake``, ``--lake var/lake/tables``), else what a lake is."""
    if is_lake(root):
        return None
    near = _near_lake(root) if isinstance(root, Path) else None
    hint = (
        f"the lake is {near}: pass --lake {near}"
        if near is not None
        else "--lake is the lake sink's `lake_path`, the directory that holds changes/ and state/"
    )
    return NotALake(f"{root}: not a cdcd lake (no {CHANGES}/ table)", hint)


def resolve_cut(lake: LakeDir, cut: Cut | None) -> Cut:
    """``cut``, or the latest one; NoCut (one line) when no compaction recorded one yet, NotALake (a
    NoCut too) when ``lake`` is no lake at all."""
    if cut is not None:
        return cut
    latest = latest_cut(lake)
    if latest is None:
        missing = not_a_lake(lake)
        if missing is not None:
            raise missing
        raise NoCut(f"{lake / CUTS}: no cut recorded yet (run cdcd lake compact)")
    return latest


VIEW_ESCAPE = "#"
"""The one character that starts an escape in a view name (see ``view_names``)."""


def escape_view_name(cache: str) -> str:
    """``cache`` spelled so that no two names give views an engine confuses: ``#`` is ``##``, an ASCII
    capital is ``#`` and its small letter (``Orders`` -> ``#orders``), and any other character that is
    not printable or not its own lower case is ``#{hex}`` of its code point (NUL -> ``#{0}``, ``Ä`` ->
    ``#{c4}``). Every character of the result is its own lower case, so catalogs that compare names
    ignoring case (DuckDB folds ASCII, Spark all of Unicode) still tell any two results apart."""
    out: list[str] = []
    for ch in cache:
        if ch == VIEW_ESCAPE:
            out.append(VIEW_ESCAPE * 2)
        elif "A" <= ch <= "Z":
            out.append(VIEW_ESCAPE + ch.lower())
        elif ch.isprintable() and ch.lower() == ch:
            out.append(ch)
        else:
            out.append(f"{VIEW_ESCAPE}{{{ord(ch):x}}}")
    return "".join(out)


def cache_of_view(view: str) -> str:
    """The cache a view name of ``view_names`` stands for: ``escape_view_name`` undone (a name without
    ``#`` is the cache's own). ValueError for text no cache's view name can be."""
    out: list[str] = []
    i = 0
    while i < len(view):
        ch = view[i]
        if ch != VIEW_ESCAPE:
            out.append(ch)
            i += 1
            continue
        nxt = view[i + 1 : i + 2]
        if nxt == VIEW_ESCAPE or "a" <= nxt <= "z":
            out.append(nxt if nxt == VIEW_ESCAPE else nxt.upper())
            i += 2
            continue
        end = view.find("}", i)
        try:
            if nxt != "{" or end < 0:
                raise ValueError
            out.append(chr(int(view[i + 2 : end], 16)))
        except (ValueError, OverflowError):
            raise ValueError(f"{printable(view)}: not a view name of a cache (a stray {VIEW_ESCAPE} at {i})") from None
        i = end + 1
    return "".join(out)


def view_names(caches: Iterable[str]) -> dict[str, str]:
    """View name -> cache name, one view per cache and never one name for two (docs/lake.md, "View
    names"). A cache keeps its own name as its view unless that name holds ``#`` or a character that is
    not printable (NUL, a newline ...), or another cache's name equals it ignoring case (``Orders``
    beside ``orders``): then the view is ``escape_view_name(cache)``. Both engines match names ignoring
    case, which is why case is escaped; a name kept as it is has no ``#``, every escaped one but a name
    already in lower case has one, so no kept name equals an escaped one, and ``cache_of_view`` turns
    any of them back into its cache."""
    names = sorted(set(caches))
    folded: dict[str, int] = {}
    for cache in names:
        folded[cache.casefold()] = folded.get(cache.casefold(), 0) + 1
    views: dict[str, str] = {}
    for cache in names:
        plain = VIEW_ESCAPE not in cache and cache.isprintable() and folded[cache.casefold()] == 1
        views[cache if plain else escape_view_name(cache)] = cache
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
