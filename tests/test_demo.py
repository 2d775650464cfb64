"""`make run` (`cdcd demo`) at a terminal, driven in a tmux pane with real key presses and signals:
Ctrl-C stops it in announced phases and it verifies (exit 0); kill -TERM starts the same stop and a
second Ctrl-C ends it at once (exit 130); afterwards none of its processes (the Spark JVM included) runs.
While it runs the pane shows `cdcd top`'s screen of the demo's node and daemon, the lake's figures among them."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from tests.support.delta_lake import check_lake
from tests.support.procs import CDCD, wait_for
from tests.support.tmux import Pane, alive, descendants

DEADLINE_S = 300.0
ROWS_LANDED = re.compile(r'cdcd_lake_rows_written_total\{cache="load"\}\s+[1-9][\d,]*\s')
TOP_FIGURES = (
    # node: WAL position and rate, who delivers and since when
    re.compile(r"WAL position\s+\d+:\d+"),
    re.compile(r"WAL rate\s+[\d.,]+ \w+/s\s+[\d,]+ entries/s"),
    re.compile(r"delivering\s+daemon \(since "),
    # daemon: position, lag, rate, backlog
    re.compile(r"position\s+\d+:\d+#\d+"),
    re.compile(r"lag\s+\d+ seg\s+[\d.]+ s"),
    re.compile(r"rate\s+[\d,]+ events/s"),
    re.compile(r"backlog\s+\d+ seg"),
    # the consumer's own: lake version, files per partition, last compaction and its duration
    re.compile(r"lake table version\s+[1-9]\d*\s"),
    re.compile(r"files per partition \(max\)\s+\d+"),
    re.compile(r"last compaction\s+(not yet|\d\d:\d\d:\d\d UTC, took [\d.,]+ s)"),
    re.compile(r"cdcd_lake_lag_seconds\s+[\d.]+"),
    # retries, stalls, dead letters: none in a clean run
    re.compile(r"no retries, stalls or dead letters reported"),
)
LAST_FIGURES = re.compile(r"^\d+s  WAL \d+:\d+  WAL rate .*  daemon \d+:\d+#\d+  .*  lake v\d+  rows [\d,]+  ", re.M)
"""The plain line of the same figures the demo leaves above its stop announcements."""


def _start(pane: Pane, tmp_path: Path) -> tuple[int, Path, set[int]]:
    """`cdcd demo` as `make run` starts it (its working directory, relative paths); once it lands rows:
    its pid, the exit-code file and every process below it (the Spark JVM among them)."""
    rc_file = tmp_path / "demo.rc"
    with pane.conf.open("a") as conf:
        conf.write("set -g default-size 200x50\n")
    pid = pane.run([*CDCD, "demo", "--rate", "1000"], rc_file, cwd=tmp_path)

    def landing() -> bool:
        return ROWS_LANDED.search(pane.capture()) is not None

    try:
        wait_for(landing, DEADLINE_S, "cdcd top's screen with rows landed in the lake", interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the pane shows:\n{pane.last}") from None
    below = descendants(pid)
    assert below, "the demo runs its Spark JVM as a child process"
    return pid, rc_file, below


def _exit_code(pane: Pane, rc_file: Path, what: str) -> int:
    try:
        wait_for(lambda: rc_file.exists() and rc_file.read_text().strip(), DEADLINE_S, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the pane shows:\n{pane.capture(history=True)}") from None
    return int(rc_file.read_text())


def test_ctrl_c_stops_in_announced_phases_verifies_and_leaves_nothing_running(pane: Pane, tmp_path: Path) -> None:
    pid, rc_file, below = _start(pane, tmp_path)
    # The table version counts this sink's commits; one more shows every figure once rows have landed.
    wait_for(
        lambda: all(f.search(pane.capture()) for f in TOP_FIGURES), DEADLINE_S, "every figure of top's screen", 0.5
    )
    screen = pane.last
    assert screen.startswith("make run"), screen
    assert "Ctrl-C: stop, catch up, compact, verify" in screen, screen
    pane.tmux("send-keys", "-t", pane.session, "C-c")
    rc = _exit_code(pane, rc_file, "the demo to finish after Ctrl-C")
    screen = pane.capture(history=True)
    assert rc == 0, screen
    lines = [s for line in screen.splitlines() if (s := line.strip()) and not s.startswith("Pane is dead")]
    phases = [line.split(" ")[0] for line in lines if line.startswith(("stopping:", "caught up", "compacted in"))]
    assert phases == ["stopping:", "caught", "compacted"], screen
    before_stop = lines[lines.index(next(line for line in lines if line.startswith("stopping:"))) - 1]
    assert LAST_FIGURES.match(before_stop), screen
    assert any(line.startswith("spark.sql> SELECT") for line in lines), screen
    assert re.fullmatch(r"verified: [\d,]+ keys, OK; stopped in \d+ s", lines[-1]), screen
    # What the node logged landed, what it holds is state: each pair equal, in words.
    counts = r"counts: WAL entries ([\d,]+) = change rows \1; node keys ([\d,]+) = state rows \2"
    assert sum(bool(re.fullmatch(counts, line)) for line in lines) == 1, screen
    assert "WARN" not in screen, "Spark's own log lines reached the terminal"
    assert '"level": "warning"' not in screen, "a warning in a clean run"
    wait_for(lambda: not alive(below | {pid}), 60, "every process of the demo to end")
    check_lake(tmp_path / "var" / "demo" / "lake", tmp_path / "var" / "demo" / "node")


def test_term_then_a_second_ctrl_c_stops_at_once(pane: Pane, tmp_path: Path) -> None:
    pid, rc_file, below = _start(pane, tmp_path)
    os.kill(pid, signal.SIGTERM)  # as systemd or `kill` would: the same orderly stop as Ctrl-C
    wait_for(lambda: "stopping:" in pane.capture(history=True), DEADLINE_S, "the stop to be announced", interval=0.2)
    pane.tmux("send-keys", "-t", pane.session, "C-c")
    rc = _exit_code(pane, rc_file, "the demo to exit at the second signal")
    assert rc == 128 + signal.SIGINT, pane.capture(history=True)
    assert "verified:" not in pane.capture(history=True)
    # The JVM ends when its parent's pipe closes; nothing is left behind.
    wait_for(lambda: not alive(below | {pid}), 60, "every process of the demo to end")
