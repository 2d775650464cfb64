"""Processes: the ``cdcd()`` runner, ``cdcd run`` daemons (start, stop, kill, their state), log lines, waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cdcd.daemon.config import load_daemon_config
from cdcd.daemon.ops import show_state

ROOT = Path(__file__).resolve().parents[2]


CDCD = [sys.executable, "-m", "cdcd"]


# --- processes, configs, state -------------------------------------------------------------------
def reap(proc: subprocess.Popen[Any] | None) -> None:
    """SIGKILL a child of ours that is still running and wait for it (the ``finally`` of every test
    that starts one: no process outlives its test, and no exception in flight is masked)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def child_env(*pythonpath: Path) -> dict[str, str]:
    """The test's environment without any CDCD_* override, importing this checkout's ``cdcd``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDCD_")}
    paths = [str(ROOT), *map(str, pythonpath)]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))
    return env


def cdcd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CDCD, *args], capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=cwd
    )


def start_daemon(
    config: Path, stderr_path: Path, env: dict[str, str] | None = None, new_session: bool = False
) -> subprocess.Popen[bytes]:
    """``cdcd run`` with its stderr (JSON log lines, then any error line) in ``stderr_path``;
    ``new_session``: out of the terminal's process group (a Ctrl-C there does not reach it)."""
    with stderr_path.open("ab") as err:
        return subprocess.Popen(
            [*CDCD, "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env or child_env(),
            start_new_session=new_session,
        )


def start_held_daemon(
    config: Path, tmp_path: Path, failpoint: str, spec: str = "pause"
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``cdcd run`` with ``failpoint`` set to ``spec`` (``pause``, ``@2=pause``: held at its second hit);
    returns once it holds there: (process, its stderr, the hold's marker: delete it to go on)."""
    holds = tmp_path / "holds"
    holds.mkdir()
    env = {**child_env(), "CDCD_FAILPOINTS": f"{failpoint}{spec if spec.startswith('@') else '=' + spec}"}
    env["CDCD_FAILPOINTS_DIR"] = str(holds)
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=env)
    marker = holds / failpoint
    wait_for(lambda: marker.exists() or proc.poll() is not None, 120, f"the daemon to hold at {failpoint}")
    assert proc.poll() is None, err.read_text()[-3000:]
    return proc, err, marker


def run_daemon_until_exit(config: Path, stderr_path: Path, timeout: float = 30, **kw: Any) -> int:
    proc = start_daemon(config, stderr_path, **kw)
    try:
        return proc.wait(timeout)
    finally:
        reap(proc)


def stop_daemon(proc: subprocess.Popen[bytes], timeout: float = 20) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    finally:
        reap(proc)


def state_show(config: Path) -> dict[str, Any]:
    """``cdcd state show --json`` as a dict."""
    res = cdcd("state", "show", "--config", str(config), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def state_position(config: Path) -> tuple[int, int, int] | None:
    parts = state_show(config)["position_parts"]
    return tuple(parts) if parts is not None else None


def polled_position(config: Path) -> tuple[int, int, int] | str | None:
    """``state_position`` for polling while a daemon may be starting.

    Works around a bug: `cdcd state show` fails with MDB_NOTFOUND while a fresh daemon has created
    its LMDB file but not yet its named databases (see test_daemon_errors.py); that answer is
    "unreadable" here, and polling goes on.
    """
    res = cdcd("state", "show", "--config", str(config), "--json")
    if res.returncode != 0 and "MDB_NOTFOUND" in res.stderr:
        return "unreadable"
    assert res.returncode == 0, res.stderr
    parts = json.loads(res.stdout)["position_parts"]
    return tuple(parts) if parts is not None else None


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_progress(
    progress: Callable[[], Any], done: Callable[[Any], bool], stall_s: float, what: str, interval: float = 0.2
) -> Any:
    """Poll ``progress()`` until ``done`` says so; fail only when it stops changing for ``stall_s``. A catch-up
    on a machine busy with other work takes as long as it takes, but one that stands still is a bug."""
    last, since = progress(), time.monotonic()
    while not done(last):
        time.sleep(interval)
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(f"no progress for {stall_s}s (at {last!r}) waiting for {what}")
    return last


def log_events(stderr_path: Path) -> list[dict[str, Any]]:
    """The JSON log lines of a daemon's stderr (the final ``cdcd: error:`` line is not JSON)."""
    out = []
    for line in stderr_path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def error_lines(stderr_path: Path) -> list[str]:
    return [line for line in stderr_path.read_text().splitlines() if line.startswith("cdcd: error:")]


def catch_up_and_stop(config: Path, err: Path, until: tuple[int, int, int], env: dict[str, str] | None = None) -> None:
    """Run the daemon until it has committed ``until``, then SIGTERM it and expect exit 0."""
    proc = start_daemon(config, err, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or polled_position(config) == until, 60, f"position {until}")
        assert proc.poll() is None, err.read_text()[-3000:]
    finally:
        rc = stop_daemon(proc)
    assert rc == 0, err.read_text()[-3000:]


def committed(config: Path) -> tuple[int, int, int] | None:
    """The daemon's committed position, read from its state (no daemon runs at this moment)."""
    parts = show_state(load_daemon_config(config, environ={}))["position_parts"]
    return tuple(parts) if parts is not None else None
