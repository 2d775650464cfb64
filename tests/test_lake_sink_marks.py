"""The lake sink reads a source's mark from the log only when it does not know it (``LakeConsumer._known``):
after its own commit (at the version it read plus one, the first attempt or one made again after losing to a
rewrite) and the rewrites after it (which move no mark) it knows the mark without replaying the log. Checked
against the log itself, version by version, and with a second sink landing the same source in between (the
first one's knowledge is then stale and must not land anything twice)."""

from __future__ import annotations

from pathlib import Path

from deltalake import DeltaTable

from cdcd.lake.landing.delta import ChangeTable
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.lake.table import CHANGES
from tests.support.delta_lake import sub_batch, wal_batch
from tests.support.lake_rewrites import rewrites, same_rows_as_wal
from tests.support.wal import wal_events
from tests.support.writer import make_node

BOUND = 6
SOURCE = "test-node"


def _sink(lake: Path) -> LakeConsumer:
    return LakeConsumer(
        LakeOptions(
            lake_path=str(lake),
            writer="deltalake",
            compact_interval_s=0,
            optimize_interval_s=0,
            max_files_per_partition=BOUND,
        )
    )


def _mark_in_log(lake: Path, version: int) -> object:
    """The source's mark at ``version``, read from the log by a table of its own."""
    table = ChangeTable(lake, False)
    table.open()
    table._dt = DeltaTable(str(lake / CHANGES), version=version)
    return table.mark(SOURCE)


def test_the_mark_the_sink_knows_is_the_one_in_the_log(tmp_path: Path) -> None:
    """One record per batch, rewrites after many of them: whenever the sink knows a version's mark without
    reading it, the log holds that mark at that version; it knew the mark for most batches."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=2, tx_per_segment=30)
    batch = wal_batch(node_dir, SOURCE)
    sink = _sink(lake)
    sink.start()
    known: list[tuple[int, object]] = []
    try:
        for k in range(len(batch.peek_slices())):
            assert sink.on_events(sub_batch(batch, k, k + 1)) is True
            if SOURCE in sink._known:
                known.append(sink._known[SOURCE])
    finally:
        sink.stop()
    assert rewrites(lake / CHANGES) >= 5, "too few rewrites to say anything"
    assert len(known) >= len(batch.peek_slices()) - 1
    for version, mark in known:
        assert _mark_in_log(lake, version) == mark, f"version {version}"
    same_rows_as_wal(lake, wal_events(node_dir))


def test_two_sinks_taking_turns_on_one_source_land_every_entry_once(tmp_path: Path) -> None:
    """Two sinks land overlapping batches of one source in turn (each one's known mark goes stale as the
    other commits, often with its own rewrites running): every WAL entry lands once."""
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=2, tx_per_segment=30)
    batch = wal_batch(node_dir, SOURCE)
    n = len(batch.peek_slices())
    first, second = _sink(lake), _sink(lake)
    first.start()
    second.start()
    try:
        for k in range(0, n, 3):
            # the first lands k..k+3, the second k+1..k+4 (two of them landed already), in turn
            assert first.on_events(sub_batch(batch, k, min(n, k + 3))) is True
            assert second.on_events(sub_batch(batch, min(n - 1, k + 1), min(n, k + 4))) is True
    finally:
        first.stop()
        second.stop()
    assert first.batches_skipped + second.batches_skipped > 0, "no batch overlapped what the other landed"
    same_rows_as_wal(lake, wal_events(node_dir))
