"""Shared fixtures: small segments so rollovers happen in tests; the lake tests' SparkSession."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node

pytest_plugins = ["tests.support.tmux"]  # the `pane` fixture


@pytest.fixture
def node_dir(tmp_path: Path) -> Path:
    return tmp_path / "node"


@pytest.fixture
def node(node_dir: Path) -> Iterator[Node]:
    n = Node.open(node_dir, wal_segment_size_bytes=64 * 1024, wal_force_archive_timeout_ms=0)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One SparkSession per test module (cdcd.lake.spark's process-wide session)."""
    from cdcd.lake import spark as spark_session
    from tests.support.lake import TEST_MASTER

    session = spark_session.acquire(TEST_MASTER, "cdcd-tests", {})
    try:
        yield session
    finally:
        spark_session.release()


@pytest.fixture(scope="module", params=["c", "python"])
def row_builder(request: pytest.FixtureRequest) -> Iterator[str]:
    """The lake's row builder (cdcd.lake.arrow.build_columns) set to the C module, then to the Python path: a test
    that asks for this runs on both. The C module must be built (the suite's ``make install`` builds it)."""
    from cdcd.lake import arrow, rows_py

    saved = arrow.build_columns
    if request.param == "python":
        arrow.build_columns = rows_py.columns
    else:
        try:
            from cdcd.lake import _rows
        except ImportError:
            pytest.fail(f"cdcd.lake._rows is not built: {arrow.BUILD_HINT}")
        arrow.build_columns = _rows.columns
    try:
        yield request.param
    finally:
        arrow.build_columns = saved
