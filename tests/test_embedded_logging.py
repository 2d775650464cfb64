"""A library prints nothing on stdout (issue 13.12): an application embedding a Node, in a real subprocess."""

from __future__ import annotations

import logging
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


def test_embedded_node_logs_nothing_below_warning_without_the_applications_logging(tmp_path: Path) -> None:
    """Without any logging set-up in the application: stdout stays empty, and so does stderr at info
    (it carried a line per segment roll: thousands in a busy application). The library's logger has a
    NullHandler, as the logging guide asks of libraries; cdcd's own warnings still reach stderr."""
    res = run_app(tmp_path, "plain")
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout == b""
    assert res.stderr == b""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("cdcd").handlers)


def test_embedded_node_warnings_reach_stderr_without_the_applications_logging(tmp_path: Path) -> None:
    """A warning of cdcd's own (a torn tail truncated at open) is not lost when the application configured nothing."""
    res = run_app(tmp_path, "plain")
    assert res.returncode == 0
    wal = sorted((tmp_path / "node" / "wal").glob("*.wal"))[-1]
    with wal.open("ab") as f:
        f.write(b"\x07\x00\x00")  # a torn frame at the active segment's tail
    res = run_app(tmp_path, "plain")
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    err = res.stderr.decode().splitlines()
    assert err and all(" WARNING cdcd." in line for line in err), err


def test_embedded_node_logs_through_the_applications_handlers(tmp_path: Path) -> None:
    """An application that configured logging (a file, WARNING) gets cdcd's records there, at its level, and
    neither stdout nor stderr carries any."""
    log = tmp_path / "app.log"
    res = run_app(tmp_path, "app-logging", str(log))
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert (res.stdout, res.stderr) == (b"", b"")
    assert log.read_text().splitlines() == ["WARNING cdcd.node app-side warning through cdcd's logger"]
