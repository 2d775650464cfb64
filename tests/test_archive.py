"""Archiving, CDC links, retention and the node-dir lock, on real files (DESIGN §2, §4).

Rollovers here come only from ``force_archive()`` or a full segment (``wal_force_archive_timeout_ms=0``)
and checkpoints only from explicit calls, so every test knows exactly which segments exist.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import REGISTRY

from cdcd.node import Node, NodeLocked
from cdcd.wal import HEADER_SIZE, Checkpoint, DataRecord, SegmentEnd, SegmentReader, WalReader
from cdcd.wal.segment import list_segments, segment_name

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
"""Children import the same ``cdcd`` as the tests."""

DETERMINISTIC: dict[str, Any] = {
    "wal_segment_size_bytes": 16 * 1024,
    "wal_force_archive_timeout_ms": 0,
    "checkpoint_interval_ms": 3_600_000,
}
VALUE_1K = "v" * 1000


def segs(d: Path) -> dict[int, Path]:
    return list_segments(d)[0]


def work_dir(node_dir: Path) -> Path:
    return node_dir / "wal"


def archive_dir(node_dir: Path) -> Path:
    return node_dir / "wal" / "archive"


def cdc_dir(node_dir: Path) -> Path:
    return node_dir / "cdc"


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def read_to_end(path: Path) -> list[Any]:
    """Every record of an archived segment file; the reader insists on a final SegmentEnd."""
    reader = SegmentReader(path, archived=True)
    records = [r for _p, r in reader]
    assert reader.ended and type(records[-1]) is SegmentEnd, path
    return records


def wal_keys(dirs: list[Path], active: int | None) -> list[Any]:
    """Keys of every DataEntry of the segments found in ``dirs``, in WAL order."""
    reader = WalReader(dirs, active_segment=active)
    return [e.decoded_key() for _p, r in reader if type(r) is DataRecord for e in r.entries]


def write_segment(node: Node, tag: str, puts: int = 3) -> int:
    """``puts`` 1 KB values, then roll: one archived segment of known content; returns its index."""
    a = node.cache("a")
    for i in range(puts):
        a.put(f"{tag}.{i}", VALUE_1K)
    closed = node.force_archive()
    assert closed is not None
    return closed


def assert_archive_linked(node_dir: Path, expected: set[int]) -> None:
    """The archive holds exactly ``expected``, each with exactly one CDC link (same inode, two names)."""
    archive, cdc = segs(archive_dir(node_dir)), segs(cdc_dir(node_dir))
    assert set(archive) == expected
    assert set(cdc) == expected
    for idx in expected:
        a, c = os.stat(archive[idx]), os.stat(cdc[idx])
        assert (a.st_dev, a.st_ino) == (c.st_dev, c.st_ino), f"link of segment {idx} is another file"
        assert a.st_nlink == 2, f"segment {idx} has {a.st_nlink} names"


# --- links ---------------------------------------------------------------------------------------
def test_every_archived_segment_has_exactly_one_cdc_link(tmp_path: Path) -> None:
    """After size- and force-triggered rollovers each archived segment has one CDC link; the work dir one segment."""
    node_dir = tmp_path / "node"
    written = []
    with Node.open(node_dir, **DETERMINISTIC) as node:
        a = node.cache("a")
        for r in range(6):
            for i in range(60):  # ~20 KB per round into 16 KiB segments: a roll by size each round
                a.put(f"r{r}.{i}", "v" * 300)
                written.append(f"r{r}.{i}")
            node.force_archive()
        last = node.wal.last_archived
        assert last + 1 >= 12, "segments did not fill up: the size rollover was not exercised"
        assert_archive_linked(node_dir, set(range(last + 1)))
        assert sorted(segs(work_dir(node_dir))) == [last + 1]
    # close() checkpoints into the active segment; one holding only that checkpoint is not rolled.
    assert_archive_linked(node_dir, set(range(last + 1)))
    assert sorted(segs(work_dir(node_dir))) == [last + 1]
    assert {type(r) for _p, r in SegmentReader(segs(work_dir(node_dir))[last + 1], archived=False)} == {Checkpoint}
    for path in segs(cdc_dir(node_dir)).values():
        read_to_end(path)
    # The CDC dir alone carries every committed entry, in order.
    assert wal_keys([cdc_dir(node_dir)], None) == written
    # Reopening finds nothing to finish; its close rolls the segment holding its start marker (Ignite
    # rolls over on stop): the daemon learns of it now.
    with Node.open(node_dir, **DETERMINISTIC):
        pass
    assert_archive_linked(node_dir, set(range(last + 2)))
    assert sorted(segs(work_dir(node_dir))) == [last + 2]
    assert wal_keys([cdc_dir(node_dir)], None) == written


# --- retention -----------------------------------------------------------------------------------
def assert_retention(node_dir: Path, checkpoint_segment: int, limit: int) -> set[int]:
    """Retention deleted the oldest archived segments only, no more than needed, none from the checkpoint on."""
    archive, cdc = segs(archive_dir(node_dir)), segs(cdc_dir(node_dir))
    size = {idx: p.stat().st_size for idx, p in cdc.items()}  # a link has the size of its segment
    kept = set(archive)
    deleted = set(cdc) - kept
    assert kept <= set(cdc)
    assert deleted == set(range(min(kept))), f"deleted {sorted(deleted)}: not the oldest ones"
    assert set(range(checkpoint_segment, max(cdc) + 1)) <= kept, "deleted a segment at/after the checkpoint"
    total = sum(size[i] for i in kept)
    if min(kept) < checkpoint_segment:
        assert total <= limit, "stopped deleting while still over archive_max_bytes"
    if deleted:
        assert total + size[max(deleted)] > limit, "deleted more than needed to get under archive_max_bytes"
    for idx in deleted:  # the link alone keeps the data: a complete, readable segment
        assert os.stat(cdc[idx]).st_nlink == 1
        read_to_end(cdc[idx])
    for idx in kept:
        assert os.path.samefile(archive[idx], cdc[idx])
    return deleted


def test_retention_deletes_oldest_archived_files_but_keeps_links_and_checkpoint_segments(tmp_path: Path) -> None:
    """Retention deletes only the oldest archived files below the checkpoint segment; their links stay readable."""
    node_dir = tmp_path / "node"
    limit = 10_000  # about three segments of three 1 KB values
    deleted_before = metric("cdcd_node_archive_segments_deleted_total")
    written = []
    with Node.open(node_dir, **DETERMINISTIC, archive_max_bytes=limit) as node:
        # No checkpoint yet: recovery would start at the first segment, so nothing may go.
        for s in range(5):
            assert write_segment(node, f"s{s}") == s
            written += [f"s{s}.{i}" for i in range(3)]
        assert set(segs(archive_dir(node_dir))) == set(range(5))
        assert sum(p.stat().st_size for p in segs(archive_dir(node_dir)).values()) > limit
        assert assert_retention(node_dir, 0, limit) == set()

        node.cache("a").put("s5.0", VALUE_1K)
        written.append("s5.0")
        cp = node.checkpoint()
        assert cp is not None and cp.segment == 5
        assert node.force_archive() == 5
        deleted = assert_retention(node_dir, 5, limit)
        assert deleted, "over the limit with segments below the checkpoint, yet nothing was deleted"

        # More segments, no new checkpoint: everything below 5 goes, 5 and later stay although over the limit.
        for s in range(6, 10):
            assert write_segment(node, f"s{s}") == s
            written += [f"s{s}.{i}" for i in range(3)]
        deleted = assert_retention(node_dir, 5, limit)
        assert deleted == set(range(5))
        assert set(segs(archive_dir(node_dir))) == set(range(5, 10))
        assert sum(p.stat().st_size for p in segs(archive_dir(node_dir)).values()) > limit
    assert metric("cdcd_node_archive_segments_deleted_total") - deleted_before == 5
    assert set(segs(cdc_dir(node_dir))) == set(range(10))
    # The links still hold the whole change stream.
    assert wal_keys([cdc_dir(node_dir)], None) == written
    # And the node reopens from its checkpoint although the oldest archived files are gone.
    with Node.open(node_dir, **DETERMINISTIC, archive_max_bytes=limit) as node:
        assert sorted(k for k, _v in node.cache("a").items()) == sorted(written)


# --- cdc_dir_max_bytes ---------------------------------------------------------------------------
def test_cdc_dir_over_limit_archives_without_linking_and_says_so(tmp_path: Path) -> None:
    """Over cdc_dir_max_bytes a segment is archived but not linked, counted, and logged as cdc_link_skipped."""
    node_dir = tmp_path / "node"
    skipped_before = metric("cdcd_node_cdc_links_skipped_total")
    with structlog.testing.capture_logs() as logs:
        with Node.open(node_dir, **DETERMINISTIC, cdc_dir_max_bytes=8_000) as node:
            for s in range(5):  # ~3.1 KB each: 0 and 1 fit, 2.. would take the dir over 8000 bytes
                assert write_segment(node, f"s{s}") == s
            assert set(segs(archive_dir(node_dir))) == set(range(5))
            assert set(segs(cdc_dir(node_dir))) == {0, 1}
            for idx in (2, 3, 4):
                assert os.stat(segs(archive_dir(node_dir))[idx]).st_nlink == 1
            assert metric("cdcd_node_cdc_links_skipped_total") - skipped_before == 3
            # The daemon consumes and deletes its links: linking resumes with the next segment.
            for p in segs(cdc_dir(node_dir)).values():
                p.unlink()
            assert write_segment(node, "s5") == 5
            assert_archive_linked_subset(node_dir, {5})
    skipped = [e for e in logs if e["event"] == "cdc_link_skipped"]
    assert [e["segment"] for e in skipped] == [2, 3, 4]
    assert all(e["log_level"] == "error" and e["cdc_dir_max_bytes"] == 8_000 for e in skipped)
    archive = segs(archive_dir(node_dir))
    assert all(e["cdc_dir_bytes"] + archive[e["segment"]].stat().st_size > 8_000 for e in skipped)
    assert metric("cdcd_node_cdc_links_skipped_total") - skipped_before == 3


def assert_archive_linked_subset(node_dir: Path, linked: set[int]) -> None:
    cdc, archive = segs(cdc_dir(node_dir)), segs(archive_dir(node_dir))
    assert set(cdc) == linked
    for idx in linked:
        assert os.path.samefile(cdc[idx], archive[idx]) and os.stat(cdc[idx]).st_nlink == 2


# --- crash in the middle of archiving ------------------------------------------------------------
_ROLL_CHILD = r"""
import sys
import time

from cdcd.node import Node

node = Node.open(sys.argv[1], wal_force_archive_timeout_ms=0, checkpoint_interval_ms=3_600_000)
a = node.cache("a")
for i in range(50):
    a.put(f"k{i}", i)
assert node.force_archive() == 0
for i in range(50, 100):
    a.put(f"k{i}", i)
node.checkpoint()  # the checkpoint lies in segment 1, the one whose archiving is interrupted below
for i in range(100, 150):
    a.put(f"k{i}", i)
assert node.force_archive() == 1  # segment 1 archived + linked; segment 2 holds just its header
print("ready", flush=True)
time.sleep(60)
"""


def run_and_kill_after_two_rolls(node_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ROLL_CHILD, str(node_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=CHILD_ENV,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "ready":
                break
        else:
            raise AssertionError(f"child exited with {proc.wait()} before rolling")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("crash_state", ["ended-not-linked", "linked-not-renamed", "renamed-next-not-created"])
def test_reopen_finishes_interrupted_archiving(tmp_path: Path, crash_state: str) -> None:
    """A node killed at any step of archiving a segment finishes the job on reopen: archived, one link, no loss."""
    node_dir = tmp_path / "node"
    run_and_kill_after_two_rolls(node_dir)
    work, archive, cdc = work_dir(node_dir), archive_dir(node_dir), cdc_dir(node_dir)
    assert sorted(segs(work)) == [2] and segs(work)[2].stat().st_size == HEADER_SIZE
    assert_archive_linked(node_dir, {0, 1})
    # Rebuild the on-disk state of a kill inside SegmentFiles.write -> Archiver.archive for segment 1.
    # Segment 2's file is only created after archive() returns, so it does not exist yet.
    segs(work)[2].unlink()
    name = segment_name(1)
    if crash_state != "renamed-next-not-created":  # rename not done: segment 1 is still in the work dir
        os.rename(archive / name, work / name)
    if crash_state == "ended-not-linked":  # after the fdatasync of SegmentEnd, before os.link
        (cdc / name).unlink()
        assert os.stat(work / name).st_nlink == 1
    elif crash_state == "linked-not-renamed":  # after os.link, before os.replace
        assert os.path.samefile(cdc / name, work / name) and os.stat(work / name).st_nlink == 2
    read_to_end(work / name if crash_state != "renamed-next-not-created" else archive / name)

    with structlog.testing.capture_logs() as logs:
        node = Node.open(node_dir, **DETERMINISTIC)
    try:
        finishing = [e["segment"] for e in logs if e["event"] == "finishing_interrupted_archive"]
        assert finishing == ([] if crash_state == "renamed-next-not-created" else [1])
        assert_archive_linked(node_dir, {0, 1})
        assert node.wal_position.segment == 2
        assert dict(node.cache("a").items()) == {f"k{i}": i for i in range(150)}
        node.cache("a").put("after", 1)
    finally:
        node.close()
    # close() rolled segment 2 (the put above) into the archive and the CDC dir.
    assert_archive_linked(node_dir, {0, 1, 2})
    assert sorted(segs(work)) == [3]
    assert wal_keys([cdc], None) == [*(f"k{i}" for i in range(150)), "after"]


# --- CDC dir on another filesystem ---------------------------------------------------------------
def test_cdc_dir_on_another_filesystem_is_refused(tmp_path: Path) -> None:
    """A cdc_dir on a different filesystem than the archive is refused at open with an error naming both."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem: /dev/shm is missing or on the same device as tmp_path")
    other = shm / f"cdcd-test-{uuid.uuid4().hex}"
    node_dir = tmp_path / "node"
    try:
        with pytest.raises(OSError, match="another filesystem") as excinfo:
            Node.open(node_dir, cdc_dir=str(other))
        message = str(excinfo.value)
        assert str(other) in message and str(archive_dir(node_dir)) in message and "hard links" in message
    finally:
        if other.exists():
            for p in other.iterdir():
                p.unlink()
            other.rmdir()
    # The refusal left the node dir unlocked and usable with a proper CDC dir.
    with Node.open(node_dir) as node:
        node.cache("a").put("k", 1)


# --- the node-dir lock ---------------------------------------------------------------------------
def test_second_open_in_same_process_fails_at_once_naming_pid(tmp_path: Path) -> None:
    """Opening an open node dir again in the same process fails immediately with NodeLocked naming this pid."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir) as node:
        node.cache("a").put("k", 1)
        t0 = time.monotonic()
        with pytest.raises(NodeLocked) as excinfo:
            Node.open(node_dir)
        assert time.monotonic() - t0 < 0.5
        assert excinfo.value.pid == os.getpid()
        assert f"pid {os.getpid()}" in str(excinfo.value) and "node.lock" in str(excinfo.value)
        node.cache("a").put("k2", 2)  # the holder is unaffected
    with Node.open(node_dir) as node:  # released on close
        assert node.cache("a").get("k2") == 2


_OPEN_CHILD = r"""
import sys
import time

from cdcd.node import Node, NodeLocked

t0 = time.monotonic()
try:
    node = Node.open(sys.argv[1])
except NodeLocked as exc:
    print("locked", exc.pid, round(time.monotonic() - t0, 3), str(exc), flush=True)
    sys.exit(0)
print("opened", flush=True)
if sys.argv[2] == "hold":
    time.sleep(60)
"""


def test_open_while_another_process_holds_the_node_fails_at_once_naming_its_pid(tmp_path: Path) -> None:
    """A node dir held by one process cannot be opened by another (either way); the error names the holder's pid."""
    node_dir = tmp_path / "node"
    # This process holds it; a child tries.
    with Node.open(node_dir):
        out = subprocess.run(
            [sys.executable, "-c", _OPEN_CHILD, str(node_dir), "try"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=CHILD_ENV,
            timeout=60,
            check=True,
        ).stdout
        line = next(x for x in out.splitlines() if x.startswith(("locked", "opened")))
        word, pid, seconds, message = line.split(" ", 3)
        assert word == "locked"
        assert int(pid) == os.getpid() and f"pid {os.getpid()}" in message
        assert float(seconds) < 0.5
    # A child holds it; this process tries.
    proc = subprocess.Popen(
        [sys.executable, "-c", _OPEN_CHILD, str(node_dir), "hold"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=CHILD_ENV,
    )
    try:
        assert proc.stdout is not None
        assert any(x.strip() == "opened" for x in proc.stdout), "child could not open the node"
        t0 = time.monotonic()
        with pytest.raises(NodeLocked) as excinfo:
            Node.open(node_dir)
        assert time.monotonic() - t0 < 0.5
        assert excinfo.value.pid == proc.pid and f"pid {proc.pid}" in str(excinfo.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # A killed holder leaves no stale lock.
    with Node.open(node_dir) as node:
        node.cache("a").put("k", 1)


# --- idle node -----------------------------------------------------------------------------------
def test_idle_node_stops_rolling_segments(tmp_path: Path) -> None:
    """An idle node with a force-archive timeout archives what it holds and then stops producing segments."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, checkpoint_interval_ms=100, wal_force_archive_timeout_ms=50) as node:
        node.cache("a").put("k", 1)
        # Archiving the put and the checkpoint after it may roll a segment or two; an idle node then stops.
        # Each round watches twenty force-archive timeouts (an observation window, not a synchronisation);
        # a node that keeps rolling never has a quiet round and fails at the deadline.
        deadline = time.monotonic() + 60
        settled: set[int] = set()
        while True:
            before = set(segs(archive_dir(node_dir)))
            time.sleep(20 * 0.05)
            settled = set(segs(archive_dir(node_dir)))
            if before and settled == before:
                break
            assert time.monotonic() < deadline, f"the idle node never settled (archived segments: {sorted(settled)})"


def test_dir_bytes_survives_files_vanishing_while_it_counts(tmp_path: Path) -> None:
    """dir_bytes, run while another thread keeps creating and deleting files (the daemon deleting links), never raises
    and counts only what exists; before the fix a FileNotFoundError here killed the node's WAL flusher."""
    import threading

    from cdcd.node.archiver import dir_bytes

    stop = threading.Event()

    def churn(first: int) -> None:
        i = 0
        while not stop.is_set():
            p = tmp_path / f"{first + i % 50:016d}.wal"
            p.write_bytes(b"x" * 100)
            p.unlink()
            i += 1

    threads = [threading.Thread(target=churn, args=(n * 100,)) for n in range(2)]
    for t in threads:
        t.start()
    (tmp_path / "keep").write_bytes(b"y" * 7)
    try:
        sizes = [dir_bytes(tmp_path) for _ in range(3000)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert min(sizes) >= 7 and max(sizes) <= 7 + 2 * 100
    assert dir_bytes(tmp_path) == 7
