"""Counts that add up and progress that stays off the log's lines (issue 46.2). The built-in load counts what the
node logged: a remove of an absent key writes nothing, so ``LoadGenerator.written`` equals the WAL's entries of the
load; its progress is a ``load_progress`` log line. ``counts_line`` (`make run`'s and `make run-cluster`'s last
counts) puts each pair that must agree side by side. On a terminal neither the node nor a daemon catching up writes
a "\\r" progress line. Real nodes, their WAL read back; real processes on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from cdcd.demo import counts_line
from cdcd.node import Node
from cdcd.node.load import LoadGenerator
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import CDCD, child_env, log_events, polled_position, reap, wait_for
from tests.support.wal import cdc_links, wal_events
from tests.support.writer import make_node


def test_written_is_what_the_wal_holds(tmp_path: Path) -> None:
    """Half the draws are removes over a small keyspace, so many hit absent keys: ``written`` still equals the
    WAL's entries, the removes among them only of keys that were there."""
    node_dir = tmp_path / "node"
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


def test_counts_line_shows_equality_and_difference() -> None:
    assert counts_line(175_485, 175_485, 16_053, 16_053) == (
        "counts: WAL entries 175,485 = change rows 175,485; node keys 16,053 = state rows 16,053"
    )
    assert counts_line(10, 9, 3, 3) == "counts: WAL entries 10 ≠ change rows 9; node keys 3 = state rows 3"


def run_on_a_terminal(argv: list[str], stderr: Path, *, until: Callable[[], bool], what: str) -> tuple[int, str]:
    """Run ``argv`` with its stdout on a pseudo-terminal (what it sees at a user's prompt) and its stderr, the log
    lines, in ``stderr``; SIGTERM it once ``until()`` holds. Returns its exit code and what it wrote on the terminal."""
    master, slave = pty.openpty()
    out = bytearray()
    with stderr.open("wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=err, env=child_env())
    os.close(slave)

    def drain() -> None:
        while select.select([master], [], [], 0)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other side closed
                return
            if not chunk:
                return
            out.extend(chunk)

    try:

        def reached() -> bool:
            drain()
            assert proc.poll() is None, stderr.read_text()[-3000:]
            return until()

        wait_for(reached, 120, what)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        drain()
    finally:
        reap(proc)
        os.close(master)
    return rc, out.decode(errors="replace")


def test_progress_never_shares_a_line_with_log_lines(tmp_path: Path) -> None:
    """On a terminal, `cdcd node run --load-rate` and `cdcd run` catching up a backlog write no "\\r" progress line
    for log lines to run into: the daemon logs `catching_up` and `catch_up_ended` instead (the load's
    `load_progress` is checked here, in the process's own log: in-process, another test of the same worker may have
    configured structlog to write elsewhere)."""
    node_dir = tmp_path / "node"
    node_config = tmp_path / "node.toml"
    node_config.write_text(f'node_dir = "{node_dir}"\nwal_mode = "background"\n')
    rc, screen = run_on_a_terminal(
        [*CDCD, "node", "run", "--config", str(node_config), "--load-rate", "2000"],
        tmp_path / "node.err",
        until=lambda: (
            any(e["event"] == "load_progress" for e in log_events(tmp_path / "node.err"))
            or len(wal_events(node_dir)) >= 4000
        ),
        what="the node's load to write 4,000 entries",
    )
    assert rc == 0, (tmp_path / "node.err").read_text()[-3000:]
    assert "\r" not in screen.replace("\r\n", "\n"), repr(screen[-500:])

    make_node(node_dir, segments=4, tx_per_segment=5)  # a backlog of several segments
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(tmp_path / "out.jsonl"))
    until = (max(cdc_links(node_dir)) + 1, 0, 0)
    rc, screen = run_on_a_terminal(
        [*CDCD, "run", "--config", str(config)],
        tmp_path / "daemon.err",
        until=lambda: polled_position(config) == until,
        what=f"the daemon to commit {until}",
    )
    assert rc == 0, (tmp_path / "daemon.err").read_text()[-3000:]
    assert "\r" not in screen.replace("\r\n", "\n"), repr(screen[-500:])
    seen = [e["event"] for e in log_events(tmp_path / "daemon.err")]
    assert "catching_up" in seen and "catch_up_ended" in seen, seen
