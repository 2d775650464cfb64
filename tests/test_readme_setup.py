"""The README's set-up shows every headline feature (issue 46.1): the node with its sample load and the daemon,
started by the README's own command lines with the repository's `config/` as it is, answer `cdcd top` with live
rates, lag and who delivers, and the README's `cdcd control ... cdc realtime on|off` switch delivery to the node
(the daemon goes PASSIVE) and back (ACTIVE again), the hand-over visible in `top`.

As written, with two substitutions: the configs are copied into a scratch working directory (so their relative
paths, `var/node1`, `var/cdc-events.jsonl`, land there), and their metrics ports, 9469 and 9470, in the configs
and in the README's lines alike, become ports from tests/support/ports.py (tests/support/shipped.py: fixed
ports would collide between parallel test workers). `cdcd top` runs with `--once --json` added, its scripting
form. At the end the one events file, the daemon's and the node's realtime consumer's, holds the WAL's entries,
each once, in WAL order."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cdcd.control import request
from tests.support.docs import README, block_with
from tests.support.procs import CDCD, child_env, polled_position, reap, wait_for, wait_progress
from tests.support.shipped import SHIPPED_PORTS, copy_shipped_config
from tests.support.wal import archived_segments, read_jsonl, wal_events


def argv(line: str, ports: dict[str, str]) -> tuple[list[str], bool]:
    """A README command line as argv (``cdcd`` is this interpreter's ``-m cdcd``, its ports substituted), and
    whether it ends in ``&``."""
    for old, new in ports.items():
        line = line.replace(old, new)
    words = shlex.split(line.split("#", maxsplit=1)[0])
    background = words[-1] == "&"
    if background:
        words = words[:-1]
    assert words[0] == "cdcd", line
    return [*CDCD, *words[1:]], background


def check_metrics_on(config: Path, ports: dict[str, str]) -> None:
    for toml, shipped in (
        ("node.toml", SHIPPED_PORTS[1]),
        ("cdcd.toml", SHIPPED_PORTS[0]),
        ("lake.toml", SHIPPED_PORTS[0]),
    ):
        assert f'metrics_address = "{ports[shipped]}"' in (config / toml).read_text(), f"config/{toml}: metrics on"


@pytest.mark.timeout(600)
def test_the_readme_setup_shows_rates_lag_and_the_realtime_hand_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = README.read_text()
    monkeypatch.chdir(tmp_path)
    ports = copy_shipped_config(tmp_path / "config")
    check_metrics_on(tmp_path / "config", ports)
    first = [ln for ln in block_with(text, "sh", "cdcd node run --config config/node.toml").splitlines() if ln]
    shown = [ln for ln in block_with(text, "sh", "cdcd top --node-dir").splitlines() if ln]
    assert [ln.split()[1] for ln in first] == ["node", "run", "state", "control"]
    assert [ln.split()[1] for ln in shown] == ["top", "control", "control"]
    node_argv, background = argv(first[0], ports)
    assert background
    daemon_argv, _ = argv(first[1], ports)
    top_argv = [*argv(shown[0], ports)[0], "--once", "--json"]
    on_argv, off_argv = argv(shown[1], ports)[0], argv(shown[2], ports)[0]
    assert on_argv[-3:] == ["cdc", "realtime", "on"] and off_argv[-3:] == ["cdc", "realtime", "off"]

    env = child_env()
    node_dir, events = Path("var/node1"), Path("var/cdc-events.jsonl")
    node_err, daemon_err = tmp_path / "node.err", tmp_path / "daemon.err"
    node = subprocess.Popen(node_argv, stdout=subprocess.DEVNULL, stderr=node_err.open("wb"), env=env)
    daemon: subprocess.Popen[bytes] | None = None

    def status() -> dict[str, Any]:
        assert node.poll() is None, node_err.read_text()[-3000:]
        if daemon is not None:
            assert daemon.poll() is None, daemon_err.read_text()[-3000:]
        try:
            reply: dict[str, Any] = request(node_dir / "control.sock", {"cmd": "status"}, timeout_s=10)
        except (FileNotFoundError, ConnectionRefusedError):
            return {}
        return reply

    def top() -> dict[str, Any]:
        res = subprocess.run(top_argv, capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        snap: dict[str, Any] = json.loads(res.stdout)
        return snap

    def top_while(delivering: str) -> dict[str, Any]:
        """`top --once --json` once every figure is there and the rates are live, with ``delivering`` delivering."""

        def live() -> dict[str, Any] | None:
            snap = top()
            rates, d = snap["rates"], snap["daemon"] or {}
            ready = (
                all(v == "ok" for v in snap["sources"].values())
                and (snap["node"] or {}).get("delivering") == delivering
                and all((rates[k] or 0) > 0 for k in ("wal_bytes_per_s", "node_entries_per_s"))
                and (delivering == "node" or (rates["daemon_events_per_s"] or 0) > 0)
                and d.get("lag_seconds") is not None
                and d.get("events_total")
            )
            return snap if ready else None

        snap: dict[str, Any] = wait_for(live, 120, f"top's live figures with the {delivering} delivering", 0.5)
        return snap

    def modes(node_mode: str, daemon_mode: str) -> None:
        def reached() -> tuple[bool, Any]:
            s = status()
            got = (s.get("realtime", {}).get("mode"), (s.get("daemon") or {}).get("mode"))
            return got == (node_mode, daemon_mode), (got, (s.get("daemon") or {}).get("position"))

        wait_progress(reached, lambda p: p[0], 60, f"realtime {node_mode}, daemon {daemon_mode}")

    try:
        wait_for(lambda: status().get("ok"), 120, "the node to answer on its control socket")
        daemon = subprocess.Popen(daemon_argv, stdout=subprocess.DEVNULL, stderr=daemon_err.open("wb"), env=env)
        modes("off", "ACTIVE")
        snap = top_while("daemon")
        assert snap["daemon"]["mode"] == "ACTIVE" and snap["node"]["realtime_mode"] == "off", snap

        res = subprocess.run(on_argv, capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() in ("realtime: try_start", "realtime: on"), res.stdout
        modes("on", "PASSIVE")
        snap = top_while("node")
        assert snap["daemon"]["mode"] == "PASSIVE" and snap["node"]["realtime_mode"] == "on", snap

        res = subprocess.run(off_argv, capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() in ("realtime: off", "realtime: stopping"), res.stdout
        modes("off", "ACTIVE")
        top_while("daemon")

        node.send_signal(signal.SIGTERM)
        assert node.wait(120) == 0, node_err.read_text()[-3000:]
        until = (max(archived_segments(node_dir)) + 1, 0, 0)
        wait_for(lambda: polled_position(Path("config/cdcd.toml")) == until, 120, f"the daemon to commit {until}")
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(120) == 0, daemon_err.read_text()[-3000:]
    finally:
        for proc in (daemon, node):
            reap(proc)
    delivered, expected = read_jsonl(events), wal_events(node_dir)
    assert len(expected) > 1000
    assert delivered == expected, "the daemon's and the node's deliveries: every entry once, in WAL order"
