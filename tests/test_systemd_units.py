"""The systemd units are valid (systemd-analyze verify) and keep their hardening."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNITS = Path(__file__).parent.parent / "systemd"


@pytest.mark.parametrize("unit", ["cdcd@.service", "cdcd-node@.service", "cdcd-kafka-to-node@.service"])
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
    from cdcd.node import Node

    Node.open(tmp_path / "node").close()
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(f'node_dir = "{tmp_path / "node"}"\nmetrics_address = ""\n[consumer]\nkind = "null"\n')
    notify_run(tmp_path, ["run", "--config", str(cfg)], watchdog_usec=200_000, timeout_s=10)


def notify_run(tmp_path: Path, args: list[str], *, watchdog_usec: int, timeout_s: float) -> None:
    """Run ``cdcd ARGS`` as systemd would (NOTIFY_SOCKET, WATCHDOG_USEC): it sends READY=1 first, then
    at least three WATCHDOG=1 pings, and STOPPING=1 on SIGTERM before exiting 0."""
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(timeout_s)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": str(watchdog_usec)}
    proc = subprocess.Popen([sys.executable, "-m", "cdcd", *args], env=env)
    try:
        messages: list[str] = []
        deadline = time.monotonic() + timeout_s
        while sum(m == "WATCHDOG=1" for m in messages) < 3 and time.monotonic() < deadline:
            messages.append(sock.recv(4096).decode())
        assert messages[0].startswith("READY=1")
        assert sum(m == "WATCHDOG=1" for m in messages) >= 3
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in messages:
            messages.append(sock.recv(4096).decode())
        assert proc.wait(timeout=max(timeout_s, 20)) == 0
    finally:
        proc.kill()
        proc.wait()
        sock.close()


SECURITY_MAX_EXPOSURE = 3.5
"""`systemd-analyze security` exposure (0 = locked down, 10 = unprotected); each service scores 3.2 on systemd 252."""


@pytest.mark.parametrize("unit", ["cdcd@.service", "cdcd-node@.service", "cdcd-kafka-to-node@.service"])
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


def unit_settings(unit: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (every value of a repeated key, in order)."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / unit).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_units_restart_policy_matches_the_cli_exit_codes() -> None:
    """Exit codes that need an operator are not restarted; a consumer failure or stall is. The node unit is
    notify-type with a watchdog and does not restart-loop on a bad config."""
    from cdcd.faults import ExitCode

    operator = {
        ExitCode.BAD_INPUT,
        ExitCode.MISSING_SEGMENT,
        ExitCode.BAD_WAL,
        ExitCode.BAD_STATE,
        ExitCode.DAMAGED_LAKE,
        ExitCode.TARGET_BEHIND,
        ExitCode.FORMAT_TOO_NEW,
    }
    daemon = unit_settings("cdcd@.service")
    assert set(daemon["RestartPreventExitStatus"][0].split()) == {str(int(c)) for c in operator}
    assert ExitCode.STALLED not in operator and ExitCode.CONSUMER_FAILED not in operator
    node = unit_settings("cdcd-node@.service")
    assert node["Type"] == ["notify"] and node["NotifyAccess"] == ["main"]
    assert node["WatchdogSec"] == ["30"] and node["Restart"] == ["on-failure"]
    node_operator = {ExitCode.BAD_INPUT, ExitCode.BAD_WAL, ExitCode.BAD_STATE, ExitCode.FORMAT_TOO_NEW}
    assert set(node["RestartPreventExitStatus"][0].split()) == {str(int(c)) for c in node_operator}


@pytest.mark.parametrize(("unit", "config"), [("cdcd@.service", "cdcd.toml"), ("cdcd-node@.service", "node.toml")])
def test_documented_config_writes_only_under_the_units_writable_path(unit: str, config: str) -> None:
    """Every path the shipped example config writes (node dir, state, consumer output) resolves, from the unit's
    WorkingDirectory, inside its ReadWritePaths: the example runs under ProtectSystem=strict as is."""
    import tomllib

    settings = unit_settings(unit)
    assert settings["ProtectSystem"] == ["strict"]
    workdir = Path(settings["WorkingDirectory"][0].replace("%i", "node1"))
    writable = [Path(p.replace("%i", "node1")) for p in settings["ReadWritePaths"][0].split()]
    data = tomllib.loads((UNITS.parent / "config" / config).read_text())
    paths = [data["node_dir"], *(data.get(k, "") for k in ("state_dir", "cdc_dir", "wal_dir", "db_dir"))]
    consumer = data.get("consumer", {})
    paths += [consumer.get("path", ""), consumer.get("lake_path", "")]
    for text in filter(None, paths):
        resolved = workdir / text  # an absolute path stays as it is
        assert any(resolved.is_relative_to(w) for w in writable), (text, resolved, writable)


def test_units_umask_keeps_state_private_and_lets_analysts_read_the_lake(tmp_path: Path) -> None:
    """Under the units' UMask, a daemon writing the lake (pyarrow writer) leaves lake files group-readable and not
    world-readable (SECURITY.md: analysts in the lake directory's group read it), while its own state stays 0600."""
    import os
    import stat

    from tests.support.config import write_daemon_config as write_config
    from tests.support.procs import start_daemon, stop_daemon, wait_for
    from tests.support.writer import make_node

    umasks = {unit_settings(u)["UMask"][0] for u in ("cdcd@.service", "cdcd-node@.service")}
    assert len(umasks) == 1
    umask = int(umasks.pop(), 8)
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=3)
    lake = tmp_path / "lake"
    lake.mkdir(mode=0o750)
    lake_consumer = {"kind": "lake", "lake_path": str(lake), "writer": "deltalake"}
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer)
    old = os.umask(umask)  # inherited by the daemon, as systemd's UMask= would set it
    try:
        proc = start_daemon(config, tmp_path / "run.err")
    finally:
        os.umask(old)
    try:
        wait_for(lambda: list(lake.rglob("*.parquet")), 120, "parquet files in the lake")
    finally:
        assert stop_daemon(proc, timeout=60) == 0
    entries = [p for p in lake.rglob("*") if not p.is_symlink()]
    assert any(p.suffix == ".parquet" for p in entries)
    for path in entries:
        mode = stat.S_IMODE(path.stat().st_mode)
        wanted = 0o050 if path.is_dir() else 0o040
        assert mode & wanted == wanted and mode & 0o007 == 0, (path, oct(mode))
    for path in (node_dir / "cdcd-state").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_node_run_sends_ready_and_watchdog_while_the_flusher_runs(tmp_path: Path) -> None:
    """`cdcd node run` under systemd (NOTIFY_SOCKET, WATCHDOG_USEC): READY=1 once open, WATCHDOG=1 pings, then
    STOPPING=1 and exit 0 on SIGTERM."""

    cfg = tmp_path / "node.toml"
    cfg.write_text(f'node_dir = "{tmp_path / "node"}"\n')
    notify_run(tmp_path, ["node", "run", "--config", str(cfg)], watchdog_usec=400_000, timeout_s=30)
