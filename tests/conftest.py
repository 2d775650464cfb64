"""Shared fixtures: small segments so rollovers happen in tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.node import Node


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
