"""A library prints nothing on stdout (issue 13.12): an application embedding a Node, in a real subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.procs import child_env

APP = textwrap.dedent(
    """
    import logging, sys
    if sys.argv[2] == "app-logging":
        logging.basicConfig(filename=sys.argv[3], level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from cdcd.node import Node
    with Node.open(sys.argv[1], wal_segment_size_bytes=4096, wal_force_archive_timeout_ms=0) as n:
        for i in range(200):
            n.cache("orders").put(i, {"v": "x" * 50})
        n.force_archive()
        logging.getLogger("cdcd.node").warning("app-side warning through cdcd's logger")
    """
)


def run_app(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    app = tmp_path / "app.py"
    app.write_text(APP)
    return subprocess.run(
        [sys.executable, str(app), str(tmp_path / "node"), *args], capture_output=True, env=child_env(), timeout=120
    )


def test_embedded_node_logs_info_to_stderr_and_nothing_to_stdout(tmp_path: Path) -> None:
    """Without any logging set-up in the application: stdout stays empty (it was console logs, debug included);
    cdcd's info lines go to stderr through the standard logging module, debug lines nowhere."""
    res = run_app(tmp_path, "plain")
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout == b""
    err = res.stderr.decode().splitlines()
    assert any(" INFO cdcd.node: event=node_opened " in line for line in err), err[:5]
    assert any(" INFO cdcd.node.wal: event=segment_archived segment=0" in line for line in err), err[:5]
    assert not [line for line in err if " DEBUG " in line or "checkpoint entries=" in line]


def test_embedded_node_logs_through_the_applications_handlers(tmp_path: Path) -> None:
    """An application that configured logging (a file, WARNING) gets cdcd's records there, at its level, and
    neither stdout nor stderr carries any."""
    log = tmp_path / "app.log"
    res = run_app(tmp_path, "app-logging", str(log))
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert (res.stdout, res.stderr) == (b"", b"")
    assert log.read_text().splitlines() == ["WARNING cdcd.node app-side warning through cdcd's logger"]
