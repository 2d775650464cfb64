"""`make run-cluster` (scripts/run-cluster.py) at a terminal, in a tmux pane: SIGTERM starts the orderly stop,
announced; a second signal, a real Ctrl-C, stops it at once (exit 130), and nothing it started runs afterwards:
not MinIO, not the Spark master or workers, not a node, a daemon or a Spark JVM. (The orderly stop to its end is
what `make run-cluster` shows; docs/cluster.md gives its phases.)"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.support.procs import wait_for
from tests.support.tmux import Pane, alive

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 300.0


def _ours(var: Path) -> set[int]:
    """Processes whose command line names the run's var dir (MinIO's data, the nodes, the daemons' configs,
    the Spark workers' work dirs), but the tmux server."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                # The pane's tmux server holds the command line it was given: not one of the run's processes.
                if str(var).encode() in cmdline and not cmdline.startswith(b"tmux\0"):
                    found.add(int(proc.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


@pytest.mark.chaos  # MinIO, a Spark cluster and three nodes for one key press: tests/test_demo.py is the quick one
def test_term_then_ctrl_c_stops_everything_at_once(pane: Pane, tmp_path: Path) -> None:
    var = tmp_path / "var"
    rc_file = tmp_path / "rc"
    script = str(ROOT / "scripts" / "run-cluster.py")
    with pane.conf.open("a") as conf:
        conf.write("set -g default-size 200x50\n")  # a row per node, a column per figure
    pid = pane.run([sys.executable, script, "--var", str(var), "--rate", "500"], rc_file)

    def running() -> bool:
        """`cdcd top`'s figures, a row per node: every node writes and a daemon has committed (node0's, which
        writes through the Spark cluster, can take minutes for its first commit on a busy machine)."""
        rows = {line.split()[0]: line for line in pane.capture().splitlines() if line.startswith("node")}
        writing = r"\s+\d+:\d+\s+[\d.]+ \w+/s [\d,]+ entries/s\s+daemon\s+"
        return all(re.match(f"node{i}{writing}", rows.get(f"node{i}", "")) for i in range(3)) and any(
            re.match(rf"node{i}{writing}\d+:\d+#\d+\s", rows.get(f"node{i}", "")) for i in range(3)
        )

    wait_for(running, DEADLINE_S, "top's figures of the three nodes", interval=1)
    header = next(line for line in pane.last.splitlines() if line.startswith("node "))
    for column in ("WAL", "WAL rate", "delivering", "daemon", "lag", "rate", "backlog", "last commit", "problems"):
        assert f" {column} " in f" {header} ", pane.last
    assert len(_ours(var)) >= 7, "MinIO, three nodes, three daemons at least"
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: "stopping:" in pane.capture(history=True), DEADLINE_S, "the stop to be announced", interval=0.5)
    pane.tmux("send-keys", "-t", pane.session, "C-c")
    wait_for(lambda: rc_file.exists() and rc_file.read_text().strip(), 120, "the script to exit", interval=0.5)
    assert int(rc_file.read_text()) == 130, pane.capture(history=True)
    assert "stopping at once" in pane.capture(history=True)
    try:
        wait_for(lambda: not alive(_ours(var)), 60, "every process of the run to end")
    except AssertionError as exc:
        left = {p: (Path(f"/proc/{p}/cmdline").read_bytes()[:200], os.getpgid(p)) for p in alive(_ours(var))}
        raise AssertionError(f"{exc}: {left}") from None
