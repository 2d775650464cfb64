"""Old Delta log files removed (cdcd/lake/maintenance/log_cleanup.py): only whole versions before a checkpoint,
only versions older than the table's ``delta.logRetentionDuration``, and in ``changes`` never a commit compaction
has yet to read; the maintainer does it after each compaction, and ``changes`` gets its short retention (and
Delta's own cleanup off) when a sink opens a table created without them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from cdcd import metrics
from cdcd.lake.cuts import latest_cut
from cdcd.lake.deltalog import app_transactions, configuration
from cdcd.lake.landing.delta import ChangeTable
from cdcd.lake.maintenance.compact import compact, compacted_version
from cdcd.lake.maintenance.log_cleanup import clean_log, clean_logs, interval_ms
from cdcd.lake.maintenance.maintainer import Maintainer, MaintainerOptions
from cdcd.lake.reading.readers import polars_frames
from cdcd.lake.table import CHANGES, CHANGES_LOG_PROPERTIES
from cdcd.lake.typed.layout import list_tables
from tests.support.delta_tables import append_changes, change, expected_state, state_rows
from tests.support.procs import wait_for

HOUR_MS = 3_600_000


def _log_versions(table: Path) -> set[int]:
    return {int(p.name[:20]) for p in (table / "_delta_log").iterdir() if p.name[:20].isdigit()}


def _checkpoints(table: Path) -> list[int]:
    return sorted(int(p.name[:20]) for p in (table / "_delta_log").glob("*.checkpoint.parquet"))


def _commits(lake: Path, first: int, count: int) -> list[dict[str, object]]:
    rows = []
    for i in range(first, first + count):
        batch = [change(("orders", "users")[i % 2], str(i % 7), None if i % 5 == 0 else f'{{"n": {i}}}', i + 1)]
        append_changes(lake, batch, source_txn=("cdcd:test-node", 1000 + i))
        rows += batch
    return rows


def _age(table: Path, below: int, ms: int) -> None:
    """Make the log files of versions below ``below`` look ``ms`` old."""
    then = time.time() - ms / 1000
    for p in (table / "_delta_log").iterdir():
        if p.name[:20].isdigit() and int(p.name[:20]) < below:
            os.utime(p, (then, then))


def test_only_versions_before_a_checkpoint_older_than_the_retention_and_not_needed_go(tmp_path: Path) -> None:
    """45 versions, a checkpoint every 10 (delta-rs writes them at 9, 19, ...): with versions below 25 two hours
    old and a retention of one hour, the versions below the checkpoint at 19 go; every version from 19 on still
    loads, 18 does not, and the latest snapshot holds every row; a source's mark at version 25 reads the same from
    the checkpoint at 19 as from version 0. ``keep_from`` (compaction's next version) holds the cleanup back to
    the checkpoint at or before it, and to nothing before the first checkpoint."""
    lake = tmp_path / "lake"
    changes = lake / CHANGES
    rows = _commits(lake, 0, 1)
    DeltaTable(str(changes)).alter.set_table_properties({"delta.checkpointInterval": "10"})
    rows += _commits(lake, 1, 43)
    latest = DeltaTable(str(changes)).version()
    assert latest == 44 and _checkpoints(changes) == [9, 19, 29, 39]
    _age(changes, 25, 2 * HOUR_MS)
    marks_at_25 = app_transactions(changes, 25)
    assert marks_at_25["cdcd:test-node"].version == 1000 + 24

    assert clean_log(changes, HOUR_MS, keep_from=5).deleted == 0  # no checkpoint at or before it
    done = clean_log(changes, HOUR_MS, keep_from=15)
    assert (done.kept_from, min(_log_versions(changes))) == (9, 9)
    assert clean_log(changes, 30 * 24 * HOUR_MS).deleted == 0  # nothing a month old
    done = clean_log(changes, HOUR_MS)
    assert done.kept_from == 19 and done.deleted > 0
    assert min(_log_versions(changes)) == 19 and max(_log_versions(changes)) == latest
    for version in (19, 33, latest):
        DeltaTable(str(changes), version=version)
    with pytest.raises(DeltaError):
        DeltaTable(str(changes), version=18)
    assert DeltaTable(str(changes)).to_pyarrow_table().num_rows == len(rows)
    # The sources' marks at a version before the newest checkpoint: from the checkpoint at or before it.
    assert app_transactions(changes, 25) == marks_at_25


def test_never_past_the_checkpoint_last_checkpoint_names(tmp_path: Path) -> None:
    """A writer killed between a checkpoint's file and ``_last_checkpoint`` leaves the pointer naming an older
    checkpoint, where readers start: the cleanup keeps it, and the table still opens."""
    lake = tmp_path / "lake"
    changes = lake / CHANGES
    _commits(lake, 0, 1)
    DeltaTable(str(changes)).alter.set_table_properties({"delta.checkpointInterval": "10"})
    _commits(lake, 1, 40)
    assert _checkpoints(changes) == [9, 19, 29, 39]
    pointer = changes / "_delta_log" / "_last_checkpoint"
    pointer.write_text(pointer.read_text().replace('"version":39', '"version":19'))
    _age(changes, 41, 2 * HOUR_MS)
    assert clean_log(changes, HOUR_MS).kept_from == 19
    assert min(_log_versions(changes)) == 19
    assert DeltaTable(str(changes)).version() == 41


def test_after_each_compaction_changes_keeps_only_what_compaction_has_yet_to_read(tmp_path: Path) -> None:
    """``changes`` with a retention of a millisecond: after a compaction its log starts at the newest checkpoint
    at or before the first version not folded, so the changes landed meanwhile (never compacted) keep every
    commit, and the next compaction, reading them from the log, makes ``state`` exactly the changes' latest
    values; the Maintainer does the cleanup after its run, and a neighbour's ``state`` log keeps its month."""
    lake = tmp_path / "lake"
    changes = lake / CHANGES
    rows = _commits(lake, 0, 1)
    DeltaTable(str(changes)).alter.set_table_properties(
        {"delta.checkpointInterval": "10", "delta.logRetentionDuration": "interval 1 milliseconds"}
    )
    rows += _commits(lake, 1, 24)
    first = compact(None, lake)
    assert first.to_version == 25
    rows += _commits(lake, 25, 13)  # versions 26-38, not compacted yet
    time.sleep(0.01)
    clean_logs(lake, compacted_version(lake))
    assert min(_log_versions(changes)) == 19  # the newest checkpoint at or before 26
    assert set(range(26, 39)) <= _log_versions(changes)
    state_log = _log_versions(lake / "state")

    maintainer = Maintainer(lake, None, MaintainerOptions(compact_interval_s=0.5, optimize_interval_s=0))
    maintainer.start()
    try:
        wait_for(lambda: compacted_version(lake) == 38, timeout=120, what="the maintainer's compaction")
        wait_for(lambda: min(_log_versions(changes)) == 29, timeout=60, what="the cleanup after it")
    finally:
        maintainer.stop()
    assert state_rows(lake) == expected_state(rows)
    assert state_log <= _log_versions(lake / "state")
    files = len([p for p in (changes / "_delta_log").iterdir() if p.name[:20].isdigit()])
    assert metrics.LAKE.get_sample_value("cdcd_lake_log_files", {"table": "changes"}) == files


def test_a_sink_sets_the_log_properties_on_an_older_changes_table_and_keeps_a_hand_set_one(tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    changes = lake / CHANGES
    append_changes(lake, [change("orders", "1", '{"n": 1}', 1)])
    dt = DeltaTable(str(changes))
    # A table from before the properties: none of them, and one set by hand.
    dt.alter.set_table_properties({"delta.logRetentionDuration": "interval 2 days"})
    for key in ("delta.deletedFileRetentionDuration", "delta.enableExpiredLogCleanup"):
        assert dt.metadata().configuration.get(key) == CHANGES_LOG_PROPERTIES[key]  # created with them: drop them
    config = dict(dt.metadata().configuration)
    config.pop("delta.deletedFileRetentionDuration")
    config.pop("delta.enableExpiredLogCleanup")
    older = tmp_path / "older"
    older_changes = older / CHANGES
    from deltalake import write_deltalake

    write_deltalake(
        str(older_changes),
        DeltaTable(str(changes)).to_pyarrow_table(),
        partition_by=["cache"],
        configuration=config,
    )
    table = ChangeTable(older, partition_by_day=False)
    table.open()
    got = DeltaTable(str(older_changes)).metadata().configuration
    assert got["delta.logRetentionDuration"] == "interval 2 days"
    assert got["delta.deletedFileRetentionDuration"] == CHANGES_LOG_PROPERTIES["delta.deletedFileRetentionDuration"]
    assert got["delta.enableExpiredLogCleanup"] == "false"
    version = DeltaTable(str(older_changes)).version()
    ChangeTable(older, partition_by_day=False).open()  # set once: a second open commits nothing
    assert DeltaTable(str(older_changes)).version() == version


@pytest.mark.parametrize(
    ("text", "ms"),
    [("interval 1 hours", HOUR_MS), ("30 days", 30 * 24 * HOUR_MS), ("interval 1 week", 7 * 24 * HOUR_MS)],
)
def test_interval_properties_read_as_delta_writes_them(text: str, ms: int) -> None:
    assert interval_ms(text) == ms


def test_an_interval_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not an interval"):
        interval_ms("forever")


def test_the_properties_read_from_the_log_are_what_delta_rs_reads(tmp_path: Path) -> None:
    """``configuration`` (what the cleanup reads the retention from, without opening the table) agrees with
    delta-rs before any checkpoint, from a checkpoint, and with a property changed after the checkpoint and one
    before it (the later value wins) — on a log whose versions before the checkpoint are already gone."""
    lake = tmp_path / "lake"
    changes = lake / CHANGES
    _commits(lake, 0, 1)
    dt = DeltaTable(str(changes))
    assert configuration(changes) == dt.metadata().configuration  # no checkpoint yet: the commits from 0
    dt.alter.set_table_properties({"delta.checkpointInterval": "10", "delta.logRetentionDuration": "interval 1 hours"})
    _commits(lake, 1, 15)
    assert _checkpoints(changes) == [9]
    dt.update_incremental()
    assert configuration(changes) == dt.metadata().configuration
    assert configuration(changes)["delta.logRetentionDuration"] == "interval 1 hours"
    dt.alter.set_table_properties({"delta.logRetentionDuration": "interval 3 hours"})
    _commits(lake, 16, 1)
    _age(changes, 9, 2 * HOUR_MS)
    assert clean_log(changes, HOUR_MS).kept_from == 9
    assert not (changes / "_delta_log" / f"{1:020d}.json").exists()  # the commit that set the properties is gone
    fresh = DeltaTable(str(changes))
    assert configuration(changes) == fresh.metadata().configuration
    assert configuration(changes)["delta.logRetentionDuration"] == "interval 3 hours"


def test_a_typed_tables_log_keeps_the_version_the_latest_cut_names(tmp_path: Path) -> None:
    """A typed table with a log retention of a millisecond and commits after the version the latest cut names
    (a property, rewrites that change no rows), checkpointed after them: the cleanup keeps the log from that
    version on, since readers open the table there; without the rule it would keep only the checkpoint's."""
    lake = tmp_path / "lake"
    _commits(lake, 0, 4)
    compact(None, lake)
    cut = latest_cut(lake)
    assert cut is not None
    typed = Path(str(list_tables(lake)["orders"]))
    named = cut.tables["orders"]
    dt = DeltaTable(str(typed))
    dt.alter.set_table_properties({"delta.logRetentionDuration": "interval 1 milliseconds"})
    for _ in range(2):
        dt.optimize.z_order(["key"])
    dt.create_checkpoint()
    assert dt.version() > named + 2 and _checkpoints(typed)[-1] == dt.version()
    before = {cache: f.rows() for cache, f in polars_frames(lake).items()}
    time.sleep(0.01)

    done = clean_logs(lake, compacted_version(lake))

    assert done["tables/orders"].kept_from <= named
    assert DeltaTable(str(typed), version=named).version() == named
    assert {cache: f.rows() for cache, f in polars_frames(lake).items()} == before
