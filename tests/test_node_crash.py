"""Crash safety of the node: real child processes committing transactions, killed with SIGKILL.

The child commits transaction n = start, start+1, ... (each a deterministic function of n, see
``tx_ops``) in ``wal_mode="fsync"`` and appends ``n`` to an ack file after each commit returns. The
settings are tiny so that segment rollovers, archiving (link + rename) and checkpoints all happen
many times a second. The parent kills the child at a random moment and checks, on a copy of the
crashed directory, that the recovered state is exactly transactions 1..N (every acked one in, the
in-flight one entirely in or entirely out), that the WAL reads cleanly, and that archive and CDC
links agree. The next child then recovers the *original* crashed directory itself, so recovery after
a crash after a recovery is exercised too.
"""

from __future__ import annotations

import inspect
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest

from cdcd.node import Node
from cdcd.wal import HEADER_SIZE, DataRecord, MissingSegment, Op, SegmentReader, WalReader
from cdcd.wal.segment import list_segments

ROOT = Path(__file__).resolve().parent.parent
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
"""Children import the same ``cdcd`` as the tests."""

NODE_SETTINGS: dict[str, Any] = {
    "wal_mode": "fsync",
    "wal_segment_size_bytes": 64 * 1024,
    "wal_force_archive_timeout_ms": 50,
    "checkpoint_interval_ms": 100,
    "checkpoint_dirty_max_entries": 500,
}

RUNS = int(os.environ.get("NODE_CRASH_RUNS", "15"))
"""Kill/recover cycles on one node dir in make test (twice as many in make chaos); raise it (e.g. 500) for a soak
run."""
SEED = 104_2024
CACHE_B_ID = zlib.crc32(b"b") & 0x7FFFFFFF


def tx_ops(n: int) -> list[tuple[str, str, Any]]:
    """The writes of transaction ``n`` as (cache, key, value); value None means remove.

    Every put carries ``"tx": n`` (the marker ``b/m<n>`` carries n itself), so every entry of a
    DataRecord names the transaction that wrote it. Removes and overwrites reach back to earlier
    transactions, so a partially applied transaction changes the state in a detectable way.
    """
    ops: list[tuple[str, str, Any]] = [
        ("a", f"x{n}.0", {"tx": n, "i": 0}),
        ("a", f"x{n}.1", {"tx": n, "i": 1, "pad": "p" * (n % 97)}),
        ("a", f"x{n}.2", {"tx": n, "i": 2}),
        ("b", f"y{n}", {"tx": n, "blob": "b" * (150 + n % 250)}),
        ("a", "last", {"tx": n}),
        ("b", "last", {"tx": n}),
    ]
    if n > 3:
        ops.append(("a", f"x{n - 3}.1", None))  # remove an earlier key
    if n > 2:
        ops.append(("a", f"x{n - 2}.2", {"tx": n, "overwritten": True}))  # overwrite an earlier key
    if n > 5 and n % 2 == 0:
        ops.append(("b", f"y{n - 5}", None))
    ops.append(("b", f"never{n}", None))  # remove of an absent key: writes nothing
    ops.append(("b", f"m{n}", n))  # the marker: present iff transaction n was applied
    return ops


def apply_tx(state: dict[str, dict[str, Any]], n: int) -> None:
    for cache, key, value in tx_ops(n):
        if value is None:
            state[cache].pop(key, None)
        else:
            state[cache][key] = value


_CHILD_MAIN = r"""
import os
import sys
import time

import structlog

from cdcd.node import Node

node_dir, ack_path, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = eval(sys.argv[4])
deadline = time.monotonic() + 30  # never outlive a dead parent for long
node = Node.open(node_dir, **settings)
b = node.cache("b")
# The parent verified a copy of this very directory: recovery here must land on the same state.
if start > 1 and b.get(f"m{start - 1}") != start - 1:
    sys.exit(f"child: marker m{start - 1} missing after recovery")
if b.get(f"m{start}") is not None:
    sys.exit(f"child: marker m{start} present before it was written")
ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.write(ack, b"ready\n")
n = start
while time.monotonic() < deadline:
    with node.transaction() as tx:
        for cache, key, value in tx_ops(n):
            if value is None:
                tx.remove(cache, key)
            else:
                tx.put(cache, key, value)
    os.write(ack, f"{n}\n".encode())  # the commit returned: durable in fsync mode
    n += 1
sys.exit("child: deadline reached without being killed")
"""


def child_script(tmp_path: Path) -> Path:
    path = tmp_path / "crash_child.py"
    path.write_text("from __future__ import annotations\n" + inspect.getsource(tx_ops) + _CHILD_MAIN)
    return path


def read_acks(path: Path) -> tuple[bool, list[int]]:
    """(child reported ready, acked transaction numbers); only complete lines count."""
    if not path.exists():
        return False, []
    lines = path.read_bytes().split(b"\n")[:-1]
    ready = bool(lines) and lines[0] == b"ready"
    return ready, [int(x) for x in lines[1:]]


def segments(d: Path) -> dict[int, Path]:
    return list_segments(d)[0]


def empty_newest_work_segment(node_dir: Path) -> Path | None:
    """The newest work segment if it is shorter than a segment header (created, header not yet written)."""
    work = segments(node_dir / "wal")
    if work and work[max(work)].stat().st_size < HEADER_SIZE:
        return work[max(work)]
    return None


def read_wal(node_dir: Path) -> list[int]:
    """Read the whole WAL (archive + work dir) and return the transaction numbers of its DataRecords.

    Raises whatever the reader raises. Checks that every DataRecord holds the entries of exactly one
    transaction: one marker, and every other put carries the same ``tx``.
    """
    work = segments(node_dir / "wal")
    active = max(work) if work else None
    reader = WalReader([node_dir / "wal" / "archive", node_dir / "wal"], active_segment=active)
    txs: list[int] = []
    for ptr, record in reader:
        if type(record) is not DataRecord:
            continue
        markers = []
        tx_values = set()
        for e in record.entries:
            key = e.decoded_key()
            if e.cache_id == CACHE_B_ID and isinstance(key, str) and key.startswith("m"):
                markers.append(e.decoded_value())
            elif e.op != Op.DELETE:
                tx_values.add(e.decoded_value()["tx"])
        assert len(markers) == 1, f"DataRecord at {ptr} holds markers {markers}"
        assert tx_values == {markers[0]}, f"DataRecord at {ptr} of tx {markers[0]} holds entries of txs {tx_values}"
        txs.append(markers[0])
    return txs


def check_links_after_crash(node_dir: Path) -> str:
    """Archive and CDC dir agree on the raw crashed directory; returns which archiving window the kill hit."""
    archive = segments(node_dir / "wal" / "archive")
    cdc = segments(node_dir / "cdc")
    work = segments(node_dir / "wal")
    # SegmentFiles creates segment N+1 only after segment N is archived: at most one work segment.
    assert len(work) <= 1, f"work dir holds segments {sorted(work)}"
    for idx, path in archive.items():
        assert idx in cdc, f"archived segment {idx} has no CDC link"
        assert os.path.samefile(cdc[idx], path), f"CDC link of segment {idx} is another file"
    if archive and work:
        assert min(work) == max(archive) + 1, (sorted(archive), sorted(work))
    extra = set(cdc) - set(archive)
    if extra:  # linked, killed before the rename: the segment is still in the work dir
        assert extra == set(work) and os.path.samefile(cdc[min(work)], work[min(work)]), f"stray CDC links {extra}"
        return "linked-not-renamed"
    if not work:
        return "no-work-segment"
    path = work[min(work)]
    if path.stat().st_size < HEADER_SIZE:
        return "segment-without-header"
    reader = SegmentReader(path, archived=False)
    for _ in reader:
        pass
    return "ended-not-archived" if reader.ended else "active"


def copy_tree_keeping_hard_links(src: Path, dst: Path) -> None:
    """Copy a node dir; files hard-linked to each other (segment + CDC link) stay hard-linked in the copy."""
    seen: dict[tuple[int, int], Path] = {}
    for dirpath, _dirnames, filenames in os.walk(src):
        target_dir = dst / Path(dirpath).relative_to(src)
        target_dir.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            source = Path(dirpath) / name
            st = source.stat(follow_symlinks=False)
            if stat.S_ISSOCK(st.st_mode):
                continue  # the killed node's control socket: nothing to copy
            ident = (st.st_dev, st.st_ino)
            if ident in seen:
                os.link(seen[ident], target_dir / name)
            else:
                shutil.copy2(source, target_dir / name, follow_symlinks=False)
                seen[ident] = target_dir / name


def open_node(node_dir: Path) -> tuple[Node, Path | None]:
    """Node.open with the crash settings (the second value is kept for callers' bookkeeping: always None)."""
    return Node.open(node_dir, **NODE_SETTINGS), None


def verify_copy(node_dir: Path, scratch: Path) -> tuple[int, dict[str, dict[str, Any]], list[int], bool]:
    """Copy the crashed dir, read its WAL, open, read every cache, close, read the WAL again.

    Returns (highest applied tx N, state, tx numbers in the WAL, whether the empty-segment bug was hit).
    """
    if scratch.exists():
        shutil.rmtree(scratch)
    copy_tree_keeping_hard_links(node_dir, scratch)
    if empty_newest_work_segment(scratch) is None:
        read_wal(scratch)  # the raw crashed WAL reads cleanly too (torn tail of the active segment is fine)
    node, removed = open_node(scratch)
    if removed is not None:
        (node_dir / "wal" / removed.name).unlink()  # the next child must get past it as well
    try:
        state = {c: dict(node.cache(c).items()) if c in node.caches() else {} for c in ("a", "b")}
    finally:
        node.close()
    markers = [k for k in state["b"] if k.startswith("m")]
    top = max((int(k[1:]) for k in markers), default=0)
    txs = read_wal(scratch)
    shutil.rmtree(scratch)
    return top, state, txs, removed is not None


def state_diff(state: dict[str, dict[str, Any]], model: dict[str, dict[str, Any]]) -> str:
    """A short description of how a recovered state differs from the model (first few keys per kind)."""
    out = []
    for cache in sorted(set(state) | set(model)):
        got, want = state.get(cache, {}), model.get(cache, {})
        missing = sorted(set(want) - set(got))[:5]
        extra = sorted(set(got) - set(want))[:5]
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:5]
        out.append(f"{cache}: missing {missing} extra {extra} wrong {[(k, got[k], want[k]) for k in wrong]}")
    return "; ".join(out)


def check_clean_dir(node_dir: Path) -> None:
    """After a clean close: one work segment; every archived segment has exactly one CDC link."""
    work = segments(node_dir / "wal")
    archive = segments(node_dir / "wal" / "archive")
    cdc = segments(node_dir / "cdc")
    assert len(work) == 1, sorted(work)
    assert set(cdc) == set(archive), (sorted(cdc), sorted(archive))
    for idx, path in archive.items():
        assert os.stat(path).st_ino == os.stat(cdc[idx]).st_ino
        assert os.stat(path).st_nlink == 2
    assert min(work) == max(archive) + 1


@pytest.mark.slow
@pytest.mark.timeout(max(180, RUNS * 16))
# The chaos scenario kill-node (make chaos) SIGKILLs a writing node at random moments at length too.
@pytest.mark.parametrize("runs", [RUNS, pytest.param(2 * RUNS, marks=pytest.mark.chaos)])
def test_sigkill_never_loses_acked_or_tears_transactions(tmp_path: Path, runs: int) -> None:
    """Repeated SIGKILLs of a committing node never lose an acked transaction nor apply one partially."""
    rng = random.Random(SEED)
    script = child_script(tmp_path)
    node_dir = tmp_path / "node"
    scratch = tmp_path / "verify"
    model: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    model_n = 0
    applied = 0  # highest transaction applied so far
    stats: dict[str, int] = {}
    bug_hits = 0
    in_flight_applied = 0
    t_start = time.monotonic()
    for run in range(runs):
        start = applied + 1
        ack_path = tmp_path / f"acks-{run}"
        log_path = tmp_path / f"child-{run}.log"
        early = run % 6 == 5  # now and then kill during startup: mid-recovery, first checkpoint, ...
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(script), str(node_dir), str(ack_path), str(start), repr(NODE_SETTINGS)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=CHILD_ENV,
            )
        try:
            if early:
                time.sleep(rng.uniform(0.0, 0.6))
            else:
                deadline = time.monotonic() + 30
                while not read_acks(ack_path)[0]:
                    assert proc.poll() is None, f"child exited with {proc.returncode}: {log_path.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, "child never became ready"
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.05, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"child died by itself: {log_path.read_text()[-3000:]}"
        _ready, acks = read_acks(ack_path)
        assert acks == list(range(start, start + len(acks))), "acks out of sequence"
        last_ack = acks[-1] if acks else start - 1

        state_name = check_links_after_crash(node_dir)
        stats[state_name] = stats.get(state_name, 0) + 1

        top, state, txs, hit = verify_copy(node_dir, scratch)
        bug_hits += hit
        # Durability: every acked transaction is in; at most the one in flight beyond it.
        assert top >= last_ack, f"run {run}: acked up to {last_ack} but recovered only up to {top}"
        assert top <= last_ack + 1, f"run {run}: recovered {top}, but only {last_ack} acked and one in flight"
        assert top >= applied, f"run {run}: transaction {applied}, seen after an earlier crash, is gone"
        # Atomicity and exactness: the state is exactly transactions 1..top, nothing of top+1.
        while model_n < top:
            model_n += 1
            apply_tx(model, model_n)
        assert state == model, f"run {run}: recovered state is not transactions 1..{top}: {state_diff(state, model)}"
        # The WAL holds each transaction exactly once, in order, and nothing of a torn one.
        assert txs == list(range(1, top + 1)), f"run {run}: WAL transactions are not 1..{top}"
        applied = top
        in_flight_applied += top == last_ack + 1

    # Finally the original directory itself: open (recovering the last crash), check, close cleanly.
    node, removed = open_node(node_dir)
    bug_hits += removed is not None
    with node:
        state = {c: dict(node.cache(c).items()) for c in ("a", "b")}
    assert state == model, state_diff(state, model)
    assert read_wal(node_dir) == list(range(1, applied + 1))
    check_clean_dir(node_dir)

    elapsed = time.monotonic() - t_start
    assert applied >= runs * 5, f"only {applied} transactions in {runs} runs: the test exercised too little"
    archived = len(segments(node_dir / "wal" / "archive"))
    assert archived >= runs // 2, f"only {archived} segments archived: rollovers were not exercised"
    print(
        f"\ncrash test: {runs} kills, {applied} transactions, {elapsed:.1f}s, "
        f"unacked in-flight transaction applied {in_flight_applied}x, archiving state at the kill {stats}"
    )
    if bug_hits:
        warnings.warn(f"hit the empty-next-segment recovery bug {bug_hits} time(s) (worked around)", stacklevel=1)


_ROLL_CHILD = r"""
import sys
import time

from cdcd.node import Node

node = Node.open(sys.argv[1], wal_force_archive_timeout_ms=0, checkpoint_interval_ms=3_600_000)
a = node.cache("a")
for i in range(50):
    a.put(f"k{i}", {"i": i})
node.checkpoint()
for i in range(50, 100):
    a.put(f"k{i}", {"i": i})
closed = node.force_archive()  # segment 0 archived + linked; segment 1 holds just its header
print("ready", closed, flush=True)
time.sleep(60)
"""


def run_and_kill_after_roll(node_dir: Path) -> None:
    """A child writes k0..k99 (checkpoint in between), rolls segment 0, and is SIGKILLed."""
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
            if line.startswith("ready"):
                assert line.split() == ["ready", "0"], line
                break
        else:
            raise AssertionError(f"child exited with {proc.wait()} before rolling")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_open_after_crash_between_segment_create_and_header_write(tmp_path: Path) -> None:
    """A node killed after creating the next segment file but before writing its header opens again with all data."""
    node_dir = tmp_path / "node"
    run_and_kill_after_roll(node_dir)
    work = segments(node_dir / "wal")
    assert sorted(work) == [1] and work[1].stat().st_size == HEADER_SIZE
    # The exact on-disk state of a kill between os.open(O_CREAT) + dir fsync and the header pwrite.
    os.truncate(work[1], 0)
    with Node.open(node_dir) as node:
        assert dict(node.cache("a").items()) == {f"k{i}": {"i": i} for i in range(100)}
        node.cache("a").put("after", 1)
    assert read_wal_entries(node_dir) == [*(f"k{i}" for i in range(100)), "after"]
    check_clean_dir(node_dir)


def read_wal_entries(node_dir: Path) -> list[Any]:
    """Keys of every DataEntry in the whole WAL, in order (raises whatever the reader raises)."""
    work = segments(node_dir / "wal")
    reader = WalReader([node_dir / "wal" / "archive", node_dir / "wal"], active_segment=max(work) if work else None)
    return [e.decoded_key() for _p, r in reader if type(r) is DataRecord for e in r.entries]


def test_failed_open_releases_the_page_store(tmp_path: Path) -> None:
    """A Node.open that fails during recovery leaves nothing open behind, so a retry in the same except block works."""
    node_dir = tmp_path / "node"
    with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
        node.cache("a").put("k", 1)
        node.force_archive()
        node.cache("a").put("k2", 2)
    # The checkpoint written by close() is in segment 1 (archived by close()): hide it and recovery must fail.
    seg1 = node_dir / "wal" / "archive" / "0000000000000001.wal"
    hidden = tmp_path / "hidden.wal"
    seg1.rename(hidden)
    try:
        Node.open(node_dir)
    except MissingSegment:
        hidden.rename(seg1)  # the operator fixes the problem and the application retries at once
        with Node.open(node_dir) as node:
            assert node.cache("a").get("k2") == 2
    else:
        raise AssertionError("open without the checkpoint's segment succeeded")
