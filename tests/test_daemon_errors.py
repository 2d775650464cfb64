"""The daemon's failure modes, each through a real ``cdcd run`` process: exit code, one clear
``cdcd: error: ...`` line on stderr, and a committed position that never passes the bad spot.

Nodes are written in-process (``make_node``: deterministic transactions, one archived segment per
group) and closed before the daemon runs, so every segment is in the CDC dir when it starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from cdcd.daemon.config import DaemonConfig
from cdcd.daemon.daemon import Daemon
from cdcd.sinks.jsonl import JsonlConsumer
from cdcd.wal import DataRecord, SegmentReader
from cdcd.wal.frame import FRAME_HEADER_SIZE
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import (
    catch_up_and_stop,
    cdcd,
    child_env,
    error_lines,
    log_events,
    polled_position,
    run_daemon_until_exit,
    start_daemon,
    state_position,
    state_show,
    stop_daemon,
    wait_for,
)
from tests.support.wal import archived_segments, cdc_links, read_jsonl, wal_events
from tests.support.writer import make_node

MISSING_HINT = (
    "(links were lost; run `cdcd control relink-lost-segments`, or `cdcd control delete-lost-segment-links` and resend)"
)


def only_error_line(err: Path) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, err.read_text()[-3000:]
    return lines[0]


def copy_on_write(link: Path, data: bytes) -> None:
    """Replace a CDC link by a modified copy, leaving the archive file it shares an inode with intact."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, link)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pos(e: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(e["pos"])  # type: ignore[return-value]


# --- gaps ------------------------------------------------------------------------------------------
def test_gap_exits_3_then_delete_lost_links_resumes_after_it(tmp_path: Path) -> None:
    """A deleted middle link stops the daemon with exit 3 "missing segment 4" without committing past it, and
    delete-lost-segment-links then lets it resume with the contiguous run after the gap."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    n = make_node(node_dir, segments=3, tx_per_segment=5)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=50)
    assert state_show(config)["fresh"] is True
    catch_up_and_stop(config, tmp_path / "run1.err", (3, 0, 0))  # caches known, links 0..2 consumed
    make_node(node_dir, segments=4, tx_per_segment=20, first_tx=n)  # segments 3..6
    expected = wal_events(node_dir)
    (node_dir / "cdc" / "0000000000000004.wal").unlink()

    err = tmp_path / "run2.err"
    assert run_daemon_until_exit(config, err) == 3
    assert only_error_line(err) == f"cdcd: error: {node_dir / 'cdc'}: missing segment 4 {MISSING_HINT}"
    failed = [e for e in log_events(err) if e["event"] == "missing_segment"]
    assert len(failed) == 1 and failed[0]["level"] == "error"
    position = state_position(config)
    assert position is not None and (3, 0, 0) <= position <= (4, 0, 0)
    got = read_jsonl(out)
    assert got == expected[: len(got)], "delivered a WAL prefix"
    assert all(e["pos"][0] < 4 for e in got)
    assert {5, 6} <= set(cdc_links(node_dir))

    res = cdcd("control", "delete-lost-segment-links", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert "gap before segment 5" in res.stdout
    assert state_position(config) == (5, 0, 0)
    assert sorted(cdc_links(node_dir)) == [5, 6]
    catch_up_and_stop(config, tmp_path / "run3.err", (7, 0, 0))
    assert read_jsonl(out) == got + [e for e in expected if e["pos"][0] >= 5]
    assert cdc_links(node_dir) == {}
    assert sorted(archived_segments(node_dir)) == list(range(7)), "the archive is never touched"


def test_relink_lost_segments_restores_the_gap_from_the_archive(tmp_path: Path) -> None:
    """relink-lost-segments hard-links missing segments back from the node's archive: after exit 3 at a two-segment
    gap the daemon delivers the whole WAL exactly (nothing lost, no resend); a segment gone from the archive too is
    named, with the fallback."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=7, tx_per_segment=10)
    expected = wal_events(node_dir)
    for seg in (2, 3):
        (node_dir / "cdc" / f"{seg:016d}.wal").unlink()
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=50)
    assert run_daemon_until_exit(config, tmp_path / "run1.err") == 3

    res = cdcd("control", "relink-lost-segments", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert "will re-link 2 segment(s) (2..3)" in res.stdout and "re-linked 2 segment(s)" in res.stdout
    # What the CDC dir holds now, for the operator to compare with the node's cdc_dir_max_bytes.
    held = sum(p.stat().st_size for p in (node_dir / "cdc").glob("*.wal")) / (1 << 20)
    assert f"The CDC dir now holds {held:.1f} MiB" in res.stdout, res.stdout
    assert os.path.samefile(node_dir / "cdc" / f"{2:016d}.wal", node_dir / "wal" / "archive" / f"{2:016d}.wal")
    catch_up_and_stop(config, tmp_path / "run2.err", (7, 0, 0))
    assert read_jsonl(out) == expected, "the whole WAL, in order, once"

    # A later gap whose segment retention already removed from the archive: reported, nothing linked.
    n2 = make_node(node_dir, segments=2, tx_per_segment=5, first_tx=10_000)
    assert n2 > 0
    (node_dir / "cdc" / f"{7:016d}.wal").unlink()
    (node_dir / "wal" / "archive" / f"{7:016d}.wal").unlink()
    res = cdcd("control", "relink-lost-segments", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert "1 segment(s) (7..7) are gone from the archive too" in res.stdout
    assert "delete-lost-segment-links" in res.stdout


def test_gap_delivers_everything_before_it_first(tmp_path: Path) -> None:
    """Segments are processed strictly in order: everything before a gap is delivered and committed before the daemon
    exits 3 at the gap."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=6, tx_per_segment=20)
    expected = wal_events(node_dir)
    (node_dir / "cdc" / "0000000000000003.wal").unlink()
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=20)
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == 3
    assert "missing segment 3" in only_error_line(err)
    assert read_jsonl(out) == [e for e in expected if e["pos"][0] < 3]
    assert state_position(config) == (3, 0, 0)
    assert sorted(state_show(config)["caches"].values()) == ["events", "orders", "users"]


def test_delete_lost_links_when_the_gap_is_at_the_committed_position(tmp_path: Path) -> None:
    """delete-lost-segment-links also repairs a gap right at the committed position (links before it already consumed),
    so the daemon resumes after the gap."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    n = make_node(node_dir, segments=3, tx_per_segment=5)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    catch_up_and_stop(config, tmp_path / "run1.err", (3, 0, 0))
    assert cdc_links(node_dir) == {}
    make_node(node_dir, segments=3, tx_per_segment=5, first_tx=n)  # segments 3, 4, 5
    (node_dir / "cdc" / "0000000000000003.wal").unlink()
    err = tmp_path / "run2.err"
    assert run_daemon_until_exit(config, err) == 3
    assert "missing segment 3" in only_error_line(err)
    assert state_position(config) == (3, 0, 0)

    res = cdcd("control", "delete-lost-segment-links", "--config", str(config), "--yes")
    assert res.returncode == 0, res.stderr
    assert state_position(config) == (4, 0, 0), res.stdout
    catch_up_and_stop(config, tmp_path / "run3.err", (6, 0, 0))
    assert read_jsonl(out) == [e for e in wal_events(node_dir) if e["pos"][0] != 3]


# --- bad segments -----------------------------------------------------------------------------------
def test_corrupt_record_exits_5_naming_file_and_offset(tmp_path: Path) -> None:
    """A flipped payload byte in a linked segment stops the daemon with exit 5 naming the file and the record's offset,
    nothing at or after it is committed, and the daemon delivers the rest once the link is good again."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=4, tx_per_segment=10)
    expected = wal_events(node_dir)
    archive = archived_segments(node_dir)[1]
    link = cdc_links(node_dir)[1]
    data_records = [p for p, r in SegmentReader(archive) if type(r) is DataRecord]
    bad = data_records[len(data_records) // 2].offset
    archive_sha = sha(archive)
    data = bytearray(link.read_bytes())
    data[bad + FRAME_HEADER_SIZE + 5] ^= 0x20
    copy_on_write(link, bytes(data))
    assert sha(archive) == archive_sha and archive.stat().st_nlink == 1

    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=30)
    assert state_position(config) is None
    err = tmp_path / "run1.err"
    assert run_daemon_until_exit(config, err) == 5
    line = only_error_line(err)
    assert re.fullmatch(
        rf"cdcd: error: {re.escape(str(link))} at offset {bad}: CRC mismatch in segment 1: "
        r"expected 0x[0-9a-f]{8}, actual 0x[0-9a-f]{8}",
        line,
    ), line
    assert [e["event"] for e in log_events(err) if e["level"] == "error"] == ["bad_segment"]
    position = state_position(config)
    assert position is None or position <= (1, bad, 0)
    got = read_jsonl(out)
    assert got == expected[: len(got)] and all(pos(e) < (1, bad, 0) for e in got)
    assert sha(archive) == archive_sha, "the archive is intact"

    # Again: same failure, same place; the position still stops short of it.
    assert run_daemon_until_exit(config, tmp_path / "run2.err") == 5
    assert only_error_line(tmp_path / "run2.err") == line
    position2 = state_position(config)
    assert position2 is None or ((position is None or position <= position2) and position2 <= (1, bad, 0))

    # The operator puts the good segment back: delivery carries on, nothing lost, nothing twice.
    tmp = link.with_name(link.name + ".tmp")
    os.link(archive, tmp)
    os.replace(tmp, link)
    catch_up_and_stop(config, tmp_path / "run3.err", (4, 0, 0))
    assert read_jsonl(out) == expected


def test_truncated_archived_segment_exits_5(tmp_path: Path) -> None:
    """An archived segment cut off in the middle of a record stops the daemon with exit 5 naming the file and that
    record's offset, and nothing from that record on is committed."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=4, tx_per_segment=10)
    expected = wal_events(node_dir)
    link = cdc_links(node_dir)[2]
    size = link.stat().st_size
    cut = size // 2
    bad = max(p.offset for p, _r in SegmentReader(link) if p.offset <= cut)
    os.truncate(link, cut)  # the link and the archive file are one inode: the archived segment is truncated
    assert archived_segments(node_dir)[2].stat().st_size == cut

    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), batch_max_events=30)
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err) == 5
    line = only_error_line(err)
    assert line.startswith(f"cdcd: error: {link} at offset {bad}: "), line
    assert "past end of file" in line or "without a SegmentEnd record" in line
    position = state_position(config)
    assert position is None or position <= (2, bad, 0)
    got = read_jsonl(out)
    assert got == expected[: len(got)] and all(pos(e) < (2, bad, 0) for e in got)


def test_foreign_files_and_symlinks_in_cdc_dir_are_ignored(tmp_path: Path) -> None:
    """Foreign files, a FIFO and symlinks in the CDC dir (even ones named like the next segment) are logged as
    cdc_dir_file_ignored warnings, never opened or deleted, and delivery is exactly the WAL."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=3, tx_per_segment=10)
    expected = wal_events(node_dir)
    cdc = node_dir / "cdc"
    fifo_target = tmp_path / "fifo"
    os.mkfifo(fifo_target)
    (cdc / "README.txt").write_text("not a segment\n")
    os.mkfifo(cdc / "0000000000000500.wal")  # opening a FIFO for reading would block the daemon
    (cdc / "0000000000000003.wal").symlink_to(archived_segments(node_dir)[0])  # the next index
    (cdc / "0000000000000600.wal").symlink_to(fifo_target)
    (cdc / "0000000000000007.wal.bak").symlink_to(cdc / "missing-target")
    foreign = sorted(
        [
            "README.txt",
            "0000000000000500.wal",
            "0000000000000003.wal",
            "0000000000000600.wal",
            "0000000000000007.wal.bak",
        ]
    )

    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    assert sorted(state_show(config)["ignored_files"]) == foreign
    err = tmp_path / "run.err"
    catch_up_and_stop(config, err, (3, 0, 0))
    assert read_jsonl(out) == expected
    warnings = [e for e in log_events(err) if e["event"] == "cdc_dir_file_ignored"]
    assert all(w["level"] == "warning" for w in warnings)
    assert sorted({Path(w["path"]).name for w in warnings}) == foreign
    assert {Path(w["path"]).name: w["reason"] for w in warnings}["0000000000000003.wal"] == "symlink"
    assert not error_lines(err)
    assert sorted(p.name for p in cdc.iterdir()) == foreign, "consumed links deleted, foreign files left alone"
    assert (cdc / "0000000000000003.wal").is_symlink() and archived_segments(node_dir)[0].exists()


def test_state_show_while_a_fresh_daemon_creates_its_state(tmp_path: Path) -> None:
    """`cdcd state show` answers "fresh" at the moment a starting daemon has created its LMDB file but not yet its
    databases (seen live: a poll during daemon start-up failed with MDB_NOTFOUND)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=1)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    state_dir = node_dir / "cdcd-state"
    state_dir.mkdir()
    lmdb.open(str(state_dir), max_dbs=2).close()  # what StateStore.__init__ has done before its open_db() calls
    res = cdcd("state", "show", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr[-500:]
    info = json.loads(res.stdout)
    assert (info["mode"], info["position"]) == ("PASSIVE", None)


# --- single instance, config --------------------------------------------------------------------------
def test_second_daemon_exits_1_naming_the_first_ones_pid(tmp_path: Path) -> None:
    """A second `cdcd run` for the same node waits lock_timeout_ms, then exits 1 naming the running daemon's pid, which
    carries on undisturbed."""
    node_dir = tmp_path / "node"
    out = tmp_path / "out.jsonl"
    make_node(node_dir, segments=2, tx_per_segment=5)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
    config2 = write_daemon_config(
        tmp_path / "second.toml", node_dir, jsonl_consumer(tmp_path / "2.jsonl"), lock_timeout_ms=700
    )
    err1 = tmp_path / "first.err"
    first = start_daemon(config, err1)
    try:
        wait_for(lambda: polled_position(config) == (2, 0, 0), 30, "the first daemon to catch up")
        err2 = tmp_path / "second.err"
        t0 = time.monotonic()
        assert run_daemon_until_exit(config2, err2) == 1
        elapsed = time.monotonic() - t0
        assert elapsed >= 0.7
        lock = node_dir / "cdcd.lock"
        assert only_error_line(err2) == (
            f"cdcd: error: another cdcd daemon runs for this node: {lock} is locked by pid {first.pid}"
        )
        assert [e["event"] for e in log_events(err2)] == ["daemon_locked"]
        assert not (tmp_path / "2.jsonl").exists(), "the second daemon never started its consumer"
        assert first.poll() is None
    finally:
        rc = stop_daemon(first)
    assert rc == 0, err1.read_text()[-3000:]
    assert read_jsonl(out) == wal_events(node_dir)


@pytest.mark.parametrize(
    ("settings", "consumer", "message"),
    [
        ({"batch_max_event": 5}, None, "unknown key 'batch_max_event' (did you mean 'batch_max_events'?)"),
        ({"batch_max_events": "many"}, None, "key 'batch_max_events': Expected `int`, got `str`"),
        ({"check_interval_ms": 1}, None, "key 'check_interval_ms': out of range: 1"),
        ({"metrics_address": "9469"}, None, "key 'metrics_address': expected host:port, got '9469'"),
        ({}, {"path": "x.jsonl"}, "missing key 'consumer.kind'"),
        (
            {},
            {"kind": "jsonl", "path": "x.jsonl", "fsynk": True},
            "consumer: unknown key 'fsynk' (did you mean 'fsync'?)",
        ),
        (
            {},
            {"kind": "pulsar"},
            "consumer: key 'kind': unknown consumer kind 'pulsar' "
            "(one of: jsonl, kafka, lake, null, python, replication)",
        ),
        (
            {},
            {"kind": "python", "class": "no_such_module:Sink"},
            "consumer: key 'class': cannot import 'no_such_module': No module named 'no_such_module'",
        ),
    ],
)
def test_bad_config_exits_2_naming_the_key(
    tmp_path: Path, settings: dict[str, Any], consumer: dict[str, Any] | None, message: str
) -> None:
    """A bad daemon config exits 2 with one stderr line naming the file and the key, before touching the node."""
    node_dir = tmp_path / "node"
    path = write_daemon_config(tmp_path / "bad.toml", node_dir, consumer or jsonl_consumer(tmp_path / "o"), **settings)
    res = cdcd("run", "--config", str(path))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"cdcd: error: {path}: {message}"]
    assert not node_dir.exists()


# --- consumers ------------------------------------------------------------------------------------------
CONSUMERS = textwrap.dedent(
    '''
    """Test consumers for `kind = "python"`."""
    import json
    import os
    import time

    from cdcd.consumer import Consumer


    def _pos(p):
        return [p.segment, p.offset, p.entry_index]


    class Recording(Consumer):
        """Appends each batch's first/last position to ``log``; raises at batch ``fail_at``."""

        def __init__(self, log, fail_at=0, dead_at=0):
            self.log, self.fail_at, self.dead_at, self.n = log, fail_at, dead_at, 0

        def alive(self):
            return not (self.dead_at and self.n + 1 >= self.dead_at)

        def on_events(self, batch):
            self.n += 1
            with open(self.log, "a") as f:
                f.write(json.dumps({"n": self.n, "first": _pos(batch.first), "last": _pos(batch.last)}) + "\\n")
            if self.n == self.fail_at:
                raise RuntimeError(f"sink down at batch {self.n}")
            return True


    class FailsToStart(Consumer):
        def start(self, registry):
            raise RuntimeError("cannot reach the sink")

        def on_events(self, batch):
            return True


    class Gated(Consumer):
        """Announces call n in ``dir/call-n.json`` and waits for ``dir/go-n`` (or ``dir/go-all``);
        returns ``answers[n-1]`` (True beyond them)."""

        def __init__(self, dir, answers):
            self.dir, self.answers, self.n = dir, answers, 0

        def on_events(self, batch):
            self.n += 1
            n = self.n
            tmp = os.path.join(self.dir, "call.tmp")
            with open(tmp, "w") as f:
                json.dump({"first": _pos(batch.first), "last": _pos(batch.last), "events": len(batch)}, f)
            os.replace(tmp, os.path.join(self.dir, f"call-{n}.json"))
            deadline = time.monotonic() + 60
            go = os.path.join(self.dir, f"go-{n}")
            go_all = os.path.join(self.dir, "go-all")
            while not (os.path.exists(go) or os.path.exists(go_all)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no go for call {n}")
                time.sleep(0.01)
            return self.answers[n - 1] if n <= len(self.answers) else True
    '''
)


def python_consumer(tmp_path: Path, cls: str, **options: Any) -> tuple[dict[str, Any], dict[str, str]]:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "test_sinks.py").write_text(CONSUMERS)
    return {"kind": "python", "class": f"test_sinks:{cls}", "options": options}, child_env(mods)


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("failure", ["raises", "not_alive"])
def test_failing_consumer_exits_4_without_committing_the_batch(tmp_path: Path, failure: str) -> None:
    """A python consumer that raises in on_events (or reports alive() False) stops the daemon with exit 4 and a clear
    error log line; batches before it are committed, the failing one is not."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=10)
    log = tmp_path / "batches.log"
    fail = {"fail_at": 3} if failure == "raises" else {"dead_at": 3}
    consumer, env = python_consumer(tmp_path, "Recording", log=str(log), **fail)
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=100)
    err = tmp_path / "run.err"
    assert run_daemon_until_exit(config, err, env=env) == 4
    message = (
        "consumer on_events() raised RuntimeError: sink down at batch 3"
        if failure == "raises"
        else "consumer reports alive() == False"
    )
    assert only_error_line(err) == f"cdcd: error: {message}"
    errors = [e for e in log_events(err) if e["level"] == "error"]
    assert [(e["event"], e["error"]) for e in errors] == [("consumer_failed", message)]
    batches = read_log(log)
    assert len(batches) == (3 if failure == "raises" else 2)
    # The failing batch starts right after batch 2 (next record); the position stops between them.
    b2_last = tuple(batches[1]["last"])
    next_first = tuple(batches[2]["first"]) if failure == "raises" else None
    position = state_position(config)
    assert position is not None and position > b2_last
    if next_first is not None:
        assert position <= next_first
    expected = wal_events(node_dir)
    firsts = [pos(e) for e in expected]
    assert firsts.index(b2_last) + 1 == len([p for p in firsts if p < position]), "exactly batches 1-2 committed"


def test_consumer_failing_to_start_exits_4(tmp_path: Path) -> None:
    """A python consumer whose start() raises stops the daemon with exit 4 and one `cdcd: error:` line, like any other
    consumer failure."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=2)
    consumer, env = python_consumer(tmp_path, "FailsToStart")
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    err = tmp_path / "run.err"
    rc = run_daemon_until_exit(config, err, env=env)
    assert "Traceback" not in err.read_text()
    assert only_error_line(err) == "cdcd: error: consumer start() raised RuntimeError: cannot reach the sink"
    assert rc == 4
    assert state_position(config) is None


def test_consumer_false_then_true_commits_only_after_true(tmp_path: Path) -> None:
    """A python consumer returning False leaves the committed state untouched (no commit at all) until a later batch
    returns True, which commits both batches."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=10)
    gate = tmp_path / "gate"
    gate.mkdir()
    consumer, env = python_consumer(tmp_path, "Gated", dir=str(gate), answers=[False, True])
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer, batch_max_events=100)
    err = tmp_path / "run.err"
    proc = start_daemon(config, err, env=env)

    def call(n: int) -> dict[str, Any]:
        path = gate / f"call-{n}.json"
        wait_for(lambda: path.exists() or proc.poll() is not None, 30, f"on_events call {n}")
        assert proc.poll() is None, err.read_text()[-3000:]
        return json.loads(path.read_text())

    try:
        c1 = call(1)
        s1 = state_show(config)
        assert s1["mode"] == "ACTIVE"
        assert s1["position_parts"] is not None and tuple(s1["position_parts"]) <= tuple(c1["first"])
        (gate / "go-1").touch()  # -> False
        c2 = call(2)
        s2 = state_show(config)
        assert (s2["position_parts"], s2["commits"]) == (s1["position_parts"], s1["commits"]), "False commits nothing"
        assert tuple(c2["first"]) > tuple(c1["last"])
        (gate / "go-2").touch()  # -> True: batches 1 and 2 are committed
        c3 = call(3)
        s3 = state_show(config)
        assert s3["commits"] > s2["commits"]
        assert tuple(c2["last"]) < tuple(s3["position_parts"]) <= tuple(c3["first"])
        (gate / "go-all").touch()
        wait_for(lambda: polled_position(config) == (2, 0, 0), 30, "catching up")
    finally:
        (gate / "go-all").touch()
        rc = stop_daemon(proc)
    assert rc == 0, err.read_text()[-3000:]


def test_sync_once_consumer_false_keeps_position(tmp_path: Path) -> None:
    """In-process: a consumer that only ever returns False gets every event, yet the daemon's position stays where it
    was and no link is deleted."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=2, tx_per_segment=3)
    out = tmp_path / "out.jsonl"

    class NeverConfirms(JsonlConsumer):
        def on_events(self, batch: Any) -> bool:
            super().on_events(batch)
            return False

    config = DaemonConfig(node_dir=str(node_dir), metrics_address="", batch_max_events=40)
    with Daemon(config, NeverConfirms(out)) as daemon:
        daemon.sync_once()
        position = daemon.state.position
    assert read_jsonl(out) == wal_events(node_dir)
    first_data = min(pos(e) for e in wal_events(node_dir))
    assert position is not None and (position.segment, position.offset, position.entry_index) <= first_data
    assert sorted(cdc_links(node_dir)) == [0, 1]
