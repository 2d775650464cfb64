"""The systemd units are valid (systemd-analyze verify) and keep their hardening."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parent.parent / "systemd"


@pytest.mark.parametrize("unit", ["cdcd@.service", "cdcd-node@.service"])
def test_unit_verifies(unit: str, tmp_path: Path) -> None:
    """`systemd-analyze verify` reports nothing for the unit (ExecStart pointed at this checkout's cdcd)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed")
    cdcd = Path(sys.executable).parent / "cdcd"
    text = (UNITS / unit).read_text().replace("/opt/cdcd/.venv/bin/cdcd", str(cdcd))
    instance = tmp_path / unit.replace("@", "@test")
    instance.write_text(text)
    res = subprocess.run([tool, "verify", str(instance)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert problems == [], problems


def test_daemon_unit_is_notify_with_watchdog_and_sandbox() -> None:
    """The daemon unit uses Type=notify with a watchdog, restarts on failure and is sandboxed."""
    text = (UNITS / "cdcd@.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=30",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "ReadWritePaths=/var/lib/cdcd/%i",
    ):
        assert line in text.splitlines(), line


def test_daemon_sends_ready_and_watchdog(tmp_path: Path) -> None:
    """`cdcd run` sends READY=1, then WATCHDOG=1 pings at half of WATCHDOG_USEC, then STOPPING=1 on SIGTERM."""
    import os
    import signal
    import socket
    import time

    from cdcd.node import Node

    Node.open(tmp_path / "node").close()
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f'node_dir = "{tmp_path / "node"}"\nmetrics_address = ""\n[consumer]\nkind = "null"\n')
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(10)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"}
    proc = subprocess.Popen([sys.executable, "-m", "cdcd", "run", "--config", str(cfg)], env=env)
    try:
        messages: list[str] = []
        deadline = time.monotonic() + 10
        while sum(m == "WATCHDOG=1" for m in messages) < 3 and time.monotonic() < deadline:
            messages.append(sock.recv(4096).decode())
        assert messages[0].startswith("READY=1")
        assert sum(m == "WATCHDOG=1" for m in messages) >= 3
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(4096).decode())
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        sock.close()


SECURITY_MAX_EXPOSURE = 3.5
"""`systemd-analyze security` exposure (0 = locked down, 10 = unprotected); both units score 3.2 on systemd 252."""


@pytest.mark.parametrize("unit", ["cdcd@.service", "cdcd-node@.service"])
def test_unit_security_exposure_stays_low(unit: str, tmp_path: Path) -> None:
    """`systemd-analyze security --offline=yes` rates the unit's sandbox at or below the recorded exposure."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed")
    instance = tmp_path / unit.replace("@", "@test")
    instance.write_text((UNITS / unit).read_text())
    res = subprocess.run([tool, "security", "--offline=yes", str(instance)], capture_output=True, text=True, timeout=60)
    if "Unknown option" in res.stderr or "unrecognized option" in res.stderr:
        pytest.skip("this systemd-analyze cannot assess unit files offline")
    lines = [line for line in res.stdout.splitlines() if "Overall exposure level" in line]
    assert lines, res.stdout[-2000:] + res.stderr[-2000:]
    exposure = float(lines[0].split(":")[1].split()[0])
    assert exposure <= SECURITY_MAX_EXPOSURE, lines[0]
