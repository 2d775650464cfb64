"""``cdcd lake check`` (cdcd/lake/reading/check.py) on real Delta tables written by the real lake sink,
damaged as an operator meets it: a deleted Parquet file of ``changes``, a torn or garbage commit
file, a garbage ``_last_checkpoint``. Each fault is one line naming the file; ``lake show`` and
``lake verify`` stop on it with DamagedLake (one line, its own exit code) instead of a traceback,
and the daemon's exit line names the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deltalake import DeltaTable

from cdcd.lake.maintenance.ops import show
from cdcd.lake.reading.check import EXIT_DAMAGED_LAKE, DamagedLake, check_lake, report_lines
from cdcd.lake.reading.verify import verify
from cdcd.lake.sink import LakeConsumer, LakeOptions
from cdcd.node.snapshot import NodeSnapshot
from tests.support.config import NO_MAINTENANCE
from tests.support.delta_lake import lake_consumer, sub_batch, wal_batch
from tests.support.lake import write_config
from tests.support.procs import error_lines, reap, start_daemon
from tests.support.writer import make_node


def build_lake(tmp: Path, batches: int = 4, *, checkpoint: bool = True) -> tuple[Path, Path]:
    """A node's WAL landed by the real sink in ``batches`` commits, then a checkpoint of ``changes``."""
    node_dir, lake = tmp / "node", tmp / "lake"
    make_node(node_dir, segments=2, tx_per_segment=20)
    batch = wal_batch(node_dir)
    n = len(batch.peek_slices())
    per = -(-n // batches)
    sink = LakeConsumer(LakeOptions(lake_path=str(lake), writer="deltalake", **NO_MAINTENANCE))
    sink.start()
    try:
        for k in range(0, n, per):
            assert sink.on_events(sub_batch(batch, k, k + per)) is True
    finally:
        sink.stop()
    if checkpoint:
        DeltaTable(str(lake / "changes")).create_checkpoint()
    return node_dir, lake


def live_files(lake: Path) -> list[str]:
    return [str(p) for p in DeltaTable(str(lake / "changes")).get_add_actions(flatten=True).column("path").to_pylist()]


def commit_file(lake: Path, version: int) -> Path:
    return lake / "changes" / "_delta_log" / f"{version:020d}.json"


def faults(lake: Path) -> list[str]:
    return [f.line for t in check_lake(lake) for f in t.faults]


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    return build_lake(tmp_path)[1]


def test_a_whole_lake_checks_out(lake: Path) -> None:
    checks = check_lake(lake)
    assert [(Path(c.table).name, c.faults) for c in checks] == [("changes", [])]
    (changes,) = checks
    live = live_files(lake)
    assert changes.version == DeltaTable(str(lake / "changes")).version() == 4
    assert changes.files == len(live) > 0
    assert report_lines(checks)[-1].endswith(": ok")
    show(lake)  # no fault: no exception


def test_deleted_parquet_file_of_changes(tmp_path: Path) -> None:
    """One line naming the deleted file and what to do; verify and show stop on it (before: every
    one of them reported OK while each read of changes failed)."""
    node_dir, lake = build_lake(tmp_path)
    victim = lake / "changes" / live_files(lake)[0]
    victim.unlink()
    lines = faults(lake)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{victim}: named by the log (version ")
    assert "but missing" in lines[0] and "restore it from a backup" in lines[0] and "cdcd resend" in lines[0]
    for call in (lambda: show(lake), lambda: verify(lake, [NodeSnapshot(node_dir)])):
        with pytest.raises(DamagedLake) as info:
            call()
        assert str(info.value) == lines[0] and info.value.exit_code == EXIT_DAMAGED_LAKE == 8
        assert "\n" not in str(info.value)


def test_unreadable_parquet_file_of_changes(lake: Path) -> None:
    victim = lake / "changes" / live_files(lake)[-1]
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:40])  # cut short: no footer
    (line,) = faults(lake)
    assert line.startswith(f"{victim}: 40 bytes where the log (version ")
    assert f"records {size:,}: overwritten or cut since its commit" in line


def test_unreadable_parquet_file_of_its_logged_size(lake: Path) -> None:
    victim = lake / "changes" / live_files(lake)[-1]
    victim.write_bytes(b"\0" * victim.stat().st_size)  # the size the log records, no Parquet in it
    (line,) = faults(lake)
    assert line.startswith(f"{victim}: unreadable Parquet (")


def test_a_copy_over_a_live_file_is_named_by_check_and_stops_verify(tmp_path: Path) -> None:
    """Issue 47: DuckDB's ``COPY … TO`` over a live data file of ``changes`` left a valid Parquet file that
    delta-rs could no longer read as the table, and `lake check` and `lake verify` both passed. Now the
    file's size differs from the one its add action records: one line naming it, `lake check` exits 8, and
    verify (which checks without reading footers) stops on it too."""
    import duckdb

    from tests.support.procs import cdcd

    node_dir, lake = build_lake(tmp_path)
    victim = lake / "changes" / live_files(lake)[0]
    logged = victim.stat().st_size
    duckdb.sql(f"COPY (SELECT 1 AS n) TO '{victim}' (FORMAT parquet)")
    assert victim.stat().st_size != logged
    (line,) = faults(lake)
    assert line.startswith(f"{victim}: {victim.stat().st_size:,} bytes where the log (version ")
    assert f"records {logged:,}: overwritten or cut since its commit: restore it from a backup" in line
    res = cdcd("lake", "check", "--lake", str(lake))
    assert res.returncode == EXIT_DAMAGED_LAKE
    assert res.stdout.splitlines()[0] == line
    res = cdcd("lake", "verify", "--lake", str(lake), "--node-dir", str(node_dir))
    assert res.returncode == EXIT_DAMAGED_LAKE
    assert res.stderr.splitlines() == [f"cdcd: error: {line}"]


def test_state_files_are_compared_with_the_log_too(tmp_path: Path) -> None:
    """``state`` (written as compaction leaves it) under the same check: a file cut short is named by
    its size; a log whose statistics record another row count than the file holds is named by rows
    (read only when the footers are read)."""
    from tests.support.delta_tables import change, compacted_lake

    lake = tmp_path / "lake"
    compacted_lake(lake, [change("orders", str(k), f'"v{k}"', k) for k in range(5)])
    assert faults(lake) == []
    state = lake / "state"
    (rel,) = DeltaTable(str(state)).get_add_actions(flatten=True).column("path").to_pylist()
    victim = state / rel
    commit = state / "_delta_log" / f"{0:020d}.json"
    text = commit.read_text()
    assert '\\"numRecords\\":5' in text
    commit.write_text(text.replace('\\"numRecords\\":5', '\\"numRecords\\":6'))
    (line,) = faults(lake)
    assert line.startswith(f"{victim}: 5 rows where the log (version 0) records 6: replaced since")
    assert [f.line for t in check_lake(lake, read_files=False) for f in t.faults] == []
    victim.write_bytes(victim.read_bytes()[:-1])
    (line,) = [f.line for t in check_lake(lake, read_files=False) for f in t.faults]
    assert line.startswith(f"{victim}: {victim.stat().st_size:,} bytes where the log (version 0) records ")


def test_torn_newest_commit(lake: Path) -> None:
    """The newest commit cut mid-line (a torn write): one line naming it, torn, delete-or-restore."""
    newest = commit_file(lake, 4)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) - 30])
    (line,) = faults(lake)
    last_line = len(data.splitlines())
    assert line.startswith(f"{newest}: line {last_line} is torn (")
    assert line.endswith(
        ": the newest commit, torn or overwritten: delete it if no reader has used it (the writer lands "
        "that batch again), else restore it from a backup"
    )
    with pytest.raises(DamagedLake, match=f"^{newest}: line "):
        show(lake)


def test_garbage_older_commit(lake: Path) -> None:
    """Garbage in an older commit: named, with restore as the remedy; the checkpoint after it, whose
    commits cannot be replayed now, is not blamed."""
    older = commit_file(lake, 2)
    older.write_bytes(b"\x00\x01garbage{{{\n")
    lines = faults(lake)
    assert len(lines) == 1 and lines[0].startswith(f"{older}: line 1 is not JSON (")
    assert lines[0].endswith(": restore it from a backup")


def test_garbage_last_checkpoint(lake: Path) -> None:
    pointer = lake / "changes" / "_delta_log" / "_last_checkpoint"
    assert json.loads(pointer.read_bytes())["version"] == 4
    pointer.write_bytes(b"\xff not json")
    (line,) = faults(lake)
    assert line.startswith(f"{pointer}: not a checkpoint pointer (JSONDecodeError") or line.startswith(
        f"{pointer}: not a checkpoint pointer (UnicodeDecodeError"
    )
    assert line.endswith("delete it: readers then find the newest checkpoint by listing the log")
    with pytest.raises(DamagedLake) as info:
        show(lake)
    assert str(info.value) == line
    pointer.unlink()  # the remedy works: the lake checks out and shows
    assert faults(lake) == []
    assert show(lake).tables[0].version == 4


def test_checkpoint_inconsistent_with_the_log(lake: Path) -> None:
    """A checkpoint whose files differ from what the commits leave (here: an older table's
    checkpoint copied over it) is named, and deleting it is the remedy (every commit is there)."""
    log_dir = lake / "changes" / "_delta_log"
    checkpoint = log_dir / f"{4:020d}.checkpoint.parquet"
    DeltaTable(str(lake / "changes"), version=2).create_checkpoint()
    older = log_dir / f"{2:020d}.checkpoint.parquet"
    checkpoint.write_bytes(older.read_bytes())
    (line,) = faults(lake)
    assert line.startswith(f"{checkpoint}: holds ") and "where the commits up to version 4 leave" in line
    assert "delete the checkpoint file(s) of this version" in line


def test_daemon_exit_names_the_damaged_file(tmp_path: Path) -> None:
    """``cdcd run`` on a lake whose newest commit is garbage: its error line names the commit file
    (before: ``DeltaError: Kernel error: Json error: ...``, no file). No checkpoint: delta-rs reads
    every commit (one a checkpoint covers it never reads; ``lake check`` does)."""
    node_dir, lake = build_lake(tmp_path, checkpoint=False)
    newest = commit_file(lake, 4)
    newest.write_bytes(b"garbage\n")
    config = write_config(tmp_path / "daemon.toml", node_dir, lake_consumer(lake))
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        rc = proc.wait(120)
    finally:
        reap(proc)
    lines = error_lines(err)
    assert rc != 0 and len(lines) == 1, err.read_text()[-3000:]
    assert f"{newest}: line 1 is not JSON" in lines[0]
    assert "Traceback" not in err.read_text()


def test_daemon_exits_with_the_damaged_lake_code(tmp_path: Path) -> None:
    node_dir, lake = build_lake(tmp_path, batches=2, checkpoint=False)
    commit_file(lake, 2).write_bytes(b"garbage\n")
    config = write_config(tmp_path / "daemon.toml", node_dir, lake_consumer(lake))
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        assert proc.wait(120) == EXIT_DAMAGED_LAKE
    finally:
        reap(proc)


def test_lake_check_covers_the_cuts_and_every_typed_table(tmp_path: Path) -> None:
    """`cdcd lake check` also checks `_cuts` and each table under `tables/` (a typed table cut short is named,
    exit 8), while the check that gates landing and compaction (`require_sound`) keeps to changes and state: one
    damaged typed table stops no other table."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from cdcd.lake.cuts import record_cut, table_path
    from cdcd.lake.reading.check import require_sound
    from tests.support.delta_tables import change, compacted_lake
    from tests.support.procs import cdcd

    lake = tmp_path / "lake"
    compacted_lake(lake, [change("orders", '"k"', '"v"', 1)])
    typed = Path(str(table_path(lake, "orders")))
    write_deltalake(str(typed), pa.table({"key": ["k"], "value": ["v"]}))
    record_cut(lake, {"orders": 0}, {}, 0)
    res = cdcd("lake", "check", "--lake", str(lake))
    assert res.returncode == 0, res.stdout + res.stderr
    assert [line.split(":")[0] for line in res.stdout.splitlines()] == [
        str(lake / name) for name in ("changes", "state", "_cuts", "tables/orders")
    ]
    (rel,) = DeltaTable(str(typed)).get_add_actions(flatten=True).column("path").to_pylist()
    victim = typed / rel
    victim.write_bytes(victim.read_bytes()[:-8])
    res = cdcd("lake", "check", "--lake", str(lake))
    assert res.returncode == EXIT_DAMAGED_LAKE
    assert res.stdout.splitlines()[0].startswith(f"{victim}: {victim.stat().st_size:,} bytes where the log ")
    assert res.stdout.splitlines()[-1].endswith(": 1 fault(s)")
    require_sound(lake, read_files=True)  # changes and state are whole: landing and compaction go on
