"""The lake's commit log on its own (no Spark): sequence numbers, what a writer keeps in memory, a broken log."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cdcd.lake.log import LakeLog, LogEntry
from cdcd.wal.pointer import WalPosition


def entry(batch: str, source: str, first: int, last: int, files: list[str] | None = None) -> LogEntry:
    return LogEntry(
        seq=0,
        batch=batch,
        source=source,
        first=WalPosition(first, 40, 0),
        last=WalPosition(last, 40, 0),
        files=files or [],
        caches={},
        committed_ns=0,
    )


def test_two_writers_see_each_others_commits_and_a_writer_keeps_only_high_water_marks(tmp_path: Path) -> None:
    """Commits by one LakeLog are read by another on refresh (contiguous seq numbers, high-water marks per source);
    a writer with keep_entries=False holds no entries however many it reads."""
    a = LakeLog(tmp_path)
    b = LakeLog(tmp_path, keep_entries=False)
    b.recover()
    for i in range(50):
        (a if i % 2 else b).commit(entry(f"x-{i}", "n1" if i % 3 else "n2", 2 * i, 2 * i + 1))
    a.refresh()
    b.refresh()
    assert [e.seq for e in a.entries] == list(range(50))
    assert sorted(int(p.stem) for p in (tmp_path / "_cdcd_log").glob("*.json")) == list(range(50))
    assert b.entries == [] and b.entry_count == 50 and a.entry_count == 50
    assert a.high_water == b.high_water == {"n1": WalPosition(99, 40, 0), "n2": WalPosition(97, 40, 0)}


def test_a_gap_in_the_log_is_an_error_naming_the_log(tmp_path: Path) -> None:
    """A missing entry file (someone deleted it) stops a writer with the log's path, not a wrong high-water mark."""
    log = LakeLog(tmp_path)
    for i in range(3):
        log.commit(entry(f"b{i}", "n", i, i))
    (tmp_path / "_cdcd_log" / f"{1:020d}.json").unlink()
    with pytest.raises(RuntimeError, match=r"_cdcd_log: lake log has a gap before 00000000000000000002\.json"):
        LakeLog(tmp_path).refresh()


def test_recover_must_come_first_for_a_writer(tmp_path: Path) -> None:
    """A writer that keeps no entries cannot recover after it has read the log (it would not see old entries)."""
    log = LakeLog(tmp_path, keep_entries=False)
    log.refresh()
    with pytest.raises(RuntimeError, match="recover"):
        log.recover()


def test_a_failing_log_write_names_the_log_file(tmp_path: Path) -> None:
    """An OSError while writing the commit entry (here: its temp file's name is taken by a directory) carries the
    entry's path, not just the errno text."""
    log = LakeLog(tmp_path)
    (tmp_path / "_cdcd_log" / ".b0.tmp").mkdir()
    with pytest.raises(OSError) as info:
        log.commit(entry("b0", "n", 1, 1))
    assert info.value.errno == errno.EISDIR
    assert str(info.value) == f"[Errno 21] lake log {tmp_path / '_cdcd_log' / f'{0:020d}.json'}: Is a directory"
    assert log.linked_batch == "" and not list((tmp_path / "_cdcd_log").glob("*.json"))


def test_publish_finishes_what_another_writer_started(tmp_path: Path) -> None:
    """publish() of an entry whose files another writer already moved (all or some) completes without an error."""
    log = LakeLog(tmp_path)
    staging = tmp_path / "_staging" / "b0" / "cache=c"
    staging.mkdir(parents=True)
    for name in ("p0.parquet", "p1.parquet"):
        (staging / name).write_bytes(b"PAR1")
    committed = log.commit(entry("b0", "n", 1, 1, ["cache=c/p0.parquet", "cache=c/p1.parquet"]))
    (tmp_path / "changes" / "cache=c").mkdir(parents=True)
    os.rename(staging / "p0.parquet", tmp_path / "changes" / "cache=c" / "p0.parquet")  # the other writer
    LakeLog(tmp_path).publish(committed)
    assert sorted(p.name for p in (tmp_path / "changes" / "cache=c").iterdir()) == ["p0.parquet", "p1.parquet"]
    assert not (tmp_path / "_staging" / "b0").exists()
    (tmp_path / "changes" / "cache=c" / "p1.parquet").unlink()
    with pytest.raises(RuntimeError, match=r"p1\.parquet named by log entry 0 is missing"):
        LakeLog(tmp_path).publish(committed)
