"""A private tmux server for tests that drive a program as a user at a terminal would: real key presses
(Ctrl-C is the terminal's SIGINT to the whole foreground process group), the screen read back with
capture-pane, the exit code recorded by the pane's shell."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import child_env, wait_for


@dataclass
class Pane:
    socket: Path
    conf: Path
    env: dict[str, str]
    last: str = ""
    session: str = "top"

    def tmux(self, *args: str) -> str:
        # -f only matters for the command that starts the server (new-session).
        cmd = ["tmux", "-S", str(self.socket), "-f", str(self.conf), *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def capture(self, history: bool = False) -> str:
        extra = ["-S", "-"] if history else []  # from the start of the scrollback
        self.last = self.tmux("capture-pane", "-p", "-J", *extra, "-t", self.session)
        return self.last

    def info(self, fmt: str) -> str:
        return self.tmux("display-message", "-p", "-t", self.session, fmt).strip()

    def run(self, argv: list[str], rc_file: Path, cwd: Path | None = None) -> int:
        """Start ``argv`` in the pane (its shell writes the exit code to ``rc_file``: tmux's own exit status
        of a pane can lag its death); the program's pid. The test process's COLUMNS/LINES (set under pytest)
        would pin the program's idea of its size: the pane's size rules."""
        line = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", f"PYTHONPATH={self.env['PYTHONPATH']}", *argv])
        if cwd is not None:
            line = f"cd {shlex.quote(str(cwd))} && {line}"
        self.tmux("new-session", "-d", "-s", self.session, f"{line}; echo $? > {shlex.quote(str(rc_file))}")
        shell_pid = int(self.info("#{pane_pid}"))
        children = Path(f"/proc/{shell_pid}/task/{shell_pid}/children")
        return int(wait_for(lambda: children.read_text().split(), 60, "the program's process")[0])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc: children of children, to the leaves)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = {int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()}
        except (FileNotFoundError, ProcessLookupError):
            continue
        todo.extend(kids - found)
        found |= kids
    return found


def alive(pids: set[int]) -> set[int]:
    """The ones still running (a zombie, dead but not reaped, counts as gone)."""
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            out.add(p)
    return out


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Pane]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run scripts/ensure-tmux.sh (make install does)")
    conf = tmp_path / "tmux.conf"
    # remain-on-exit: the dead pane stays, so its exit status and restored screen can be read.
    conf.write_text("set -g remain-on-exit on\nset -g history-limit 5000\n")
    p = Pane(tmp_path / "tmux.sock", conf, child_env())  # a private server, its socket gone with tmp_path
    try:
        yield p
    finally:
        subprocess.run(["tmux", "-S", str(p.socket), "kill-server"], capture_output=True, timeout=30)
