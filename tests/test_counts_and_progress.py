"""The built-in load counts what the node logged (issue 46.2): a remove of an absent key writes nothing, so
``LoadGenerator.written`` equals the WAL's entries of the load, removes of absent keys among its draws or not;
and its progress is a ``load_progress`` log line. A real node, its WAL read back after close; ``counts_line``
(`make run`'s and `make run-cluster`'s last counts) puts each pair that must agree side by side."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cdcd.demo import counts_line
from cdcd.node import Node
from cdcd.node.load import LoadGenerator
from tests.support.procs import wait_for
from tests.support.wal import wal_events


def test_written_is_what_the_wal_holds(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Half the draws are removes over a small keyspace, so many hit absent keys: ``written`` still equals the
    WAL's entries, the removes among them only of keys that were there."""
    node_dir = tmp_path / "node"
    caplog.set_level(logging.INFO, logger="cdcd")
    with Node.open(node_dir, wal_mode="background", cdc_enabled=False) as node:
        load = LoadGenerator(node, 5000, keyspace=200, remove_ratio=0.5, seed=7, progress_every_s=0.2)
        load.start()
        try:
            wait_for(lambda: load.written >= 3000, 60, "3,000 entries written")
        finally:
            load.stop()
        written = load.written
        drawn_removes = load.removes_drawn
    events = wal_events(node_dir)
    assert len(events) == written
    deletes = sum(e["op"] == "delete" for e in events)
    assert 0 < deletes < drawn_removes, "some removes hit absent keys and wrote nothing; they are not counted"
    progress = [r for r in caplog.records if "load_progress" in r.getMessage()]
    assert progress, "the load says how far it got in log lines"


def test_counts_line_shows_equality_and_difference() -> None:
    assert counts_line(175_485, 175_485, 16_053, 16_053) == (
        "counts: WAL entries 175,485 = change rows 175,485; node keys 16,053 = state rows 16,053"
    )
    assert counts_line(10, 9, 3, 3) == "counts: WAL entries 10 ≠ change rows 9; node keys 3 = state rows 3"
