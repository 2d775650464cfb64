"""A full node disk: WAL writes wait for space and resume with nothing lost; a checkpoint that cannot
be written names the database file and the full disk (LMDB itself only says "Input/output error")."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd import metrics
from cdcd.node import Node
from tests.support.procs import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

VALUE = "x" * 1000


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path, leave_bytes: int) -> Path:
    """A file taking all free space of ``mnt`` but ``leave_bytes``."""
    st = os.statvfs(mnt)
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        remaining = st.f_bavail * st.f_frsize - leave_bytes
        block = b"\0" * (1 << 20)
        while remaining > 0:
            remaining -= f.write(block[: min(len(block), remaining)])
    return filler


def disk_full_gauge() -> float | None:
    return metrics.NODE.get_sample_value("cdcd_node_wal_disk_full")


def test_wal_waits_for_space_and_resumes(small_fs: Path) -> None:
    node_dir = small_fs / "node"
    node = Node.open(node_dir, wal_segment_size_bytes=1 << 20)
    cache = node.cache("c")
    filler = fill(small_fs, leave_bytes=512 * 1024)
    n_puts = 3000
    done: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(n_puts):
                cache.put(i, VALUE)
                done.append(i)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    wait_for(lambda: disk_full_gauge() == 1.0, 60, "the WAL to report a full disk")
    stalled_at = len(done)
    assert stalled_at < n_puts and not errors
    filler.unlink()
    t.join(120)
    assert not t.is_alive()
    assert errors == []
    assert done == list(range(n_puts))
    assert disk_full_gauge() == 0.0
    node.close()

    node = Node.open(node_dir, wal_segment_size_bytes=1 << 20)
    try:
        assert dict(node.cache("c").items()) == {i: VALUE for i in range(n_puts)}
    finally:
        node.close()


def test_checkpoint_on_full_disk_names_it(small_fs: Path) -> None:
    node_dir = small_fs / "node"
    node = Node.open(node_dir, wal_segment_size_bytes=1 << 20, wal_mode="background")
    cache = node.cache("c")
    for i in range(2000):
        cache.put(i, VALUE)
    node.flush()
    fill(small_fs, leave_bytes=0)
    with pytest.raises(OSError) as info:
        node.checkpoint()
    message = str(info.value)
    assert str(node_dir / "db" / "data.mdb") in message
    assert "disk full" in message
    (small_fs / "filler").unlink()
    node.close()


def test_a_full_disk_during_checkpoints_is_waited_out_and_writes_resume(small_fs: Path, tmp_path: Path) -> None:
    """Checkpoints failing on a full disk are retried, not fatal: status says the node waits for
    space, writers wait once the dirty map is full, and everything resumes once space is freed
    (before, the node refused every write for good after one failed checkpoint). The page store
    is on the small file system, the WAL elsewhere: only checkpoints meet the full disk."""
    node_dir = tmp_path / "node"
    settings = {"db_dir": str(small_fs / "db"), "wal_segment_size_bytes": 1 << 20}
    node = Node.open(node_dir, checkpoint_interval_ms=20, checkpoint_dirty_max_entries=500, **settings)
    n_puts = 3000
    try:
        cache = node.cache("c")
        cache.put_all({i: VALUE for i in range(200)})
        node.checkpoint()
        filler = fill(small_fs, leave_bytes=0)
        done: list[int] = []
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for i in range(200, 200 + n_puts):
                    cache.put(i, VALUE * 2)
                    done.append(i)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=writer)
        t.start()
        try:
            wait_for(
                lambda: node.writes_state().startswith("waiting for disk space"), 60, "checkpoints to wait for space"
            )
            assert node.status()["writes"].startswith("waiting for disk space:")
            assert node.failure is None and not errors
        finally:
            filler.unlink()
        t.join(120)
        assert not t.is_alive() and errors == []
        assert len(done) == n_puts
        wait_for(lambda: node.writes_state() == "ok", 60, "checkpoints to resume")
        cache.put("after", 1)
        # None when the checkpointer thread (every 20 ms) got there first; a failed checkpoint puts its entries back.
        node.checkpoint()
        assert not node.writes.dirty, "a checkpoint after space came back moved every write into the page store"
    finally:
        node.close()
    with Node.open(node_dir, **settings) as node:
        expected = {i: VALUE for i in range(200)} | {i: VALUE * 2 for i in range(200, 200 + n_puts)} | {"after": 1}
        assert dict(node.cache("c").items()) == expected
