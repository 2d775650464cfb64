"""Helpers for reading the lake outside Spark (DuckDB's delta extension from its PyPI wheel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
