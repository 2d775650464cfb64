"""The security defaults of SECURITY.md, checked on the real package and real processes: no unsafe
deserialisation or code evaluation in the code, private files and directories, secrets masked in
logs, error lines, `state show` and `control status`, metrics on loopback by default."""

from __future__ import annotations

import ast
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from cdcd.daemon.config import DaemonConfig
from cdcd.node import Node
from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import (
    ROOT,
    cdcd,
    child_env,
    error_lines,
    run_daemon_until_exit,
    start_daemon,
    stop_daemon,
    wait_for,
)
from tests.support.writer import make_node

PACKAGE = ROOT / "cdcd"
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "__import__", "compile"}

SECRET_PASSWORD = "hunter2-Xq7"
SECRET_TOKEN = "tok-5f3a9c-secret"

PLUGIN = '''
"""A consumer whose options carry secrets and whose start() fails with a URL holding a password."""
from cdcd.consumer import Consumer


class Leaky(Consumer):
    def __init__(self, token, url, fail=True):
        self.url = url
        self.fail = fail

    def start(self, registry=None):
        if self.fail:
            raise ConnectionError(f"cannot reach {self.url}")

    def on_events(self, batch):
        return True
'''


def forbidden_uses(source: str, filename: str) -> list[str]:
    """Imports of pickle-like deserialisers, calls of eval/exec/compile/__import__, os.system/popen, shell=."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            problems += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            problems.append(f"{where} from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                problems.append(f"{where} {func.id}()")
            if isinstance(func, ast.Attribute) and func.attr in ("system", "popen"):
                problems.append(f"{where} .{func.attr}()")
            for kw in node.keywords:
                if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    problems.append(f"{where} shell=...")
    return problems


def test_package_never_unpickles_or_evaluates_code() -> None:
    """No module of the package imports a pickle-like deserialiser, calls eval/exec/compile/__import__ or runs a
    shell (os.system, os.popen, shell=True)."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, "the package was found"
    problems = [p for f in files for p in forbidden_uses(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == []


def test_the_scan_flags_each_forbidden_construct() -> None:
    """forbidden_uses reports every construct it is meant to forbid (so the package check can fail)."""
    sample = "import pickle\nfrom marshal import loads\neval('1')\nimport os\nos.system('x')\nf(shell=True)\n"
    found = forbidden_uses(sample, "s.py")
    assert found == [
        "s.py:1 import pickle",
        "s.py:2 from marshal import ...",
        "s.py:3 eval()",
        "s.py:5 .system()",
        "s.py:6 shell=...",
    ]


def private_problems(root: Path) -> list[str]:
    """Files with any group/other permission bit, directories other than 0700, ``root`` and under it."""
    out = []
    if stat.S_IMODE(root.stat().st_mode) != 0o700:
        out.append(f"{root} dir {stat.S_IMODE(root.stat().st_mode):o}")
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            mode = _mode(os.path.join(dirpath, name))
            if mode is not None and mode != 0o700:
                out.append(f"{os.path.join(dirpath, name)} dir {mode:o}")
        for name in filenames:
            path = os.path.join(dirpath, name)
            mode = _mode(path)
            if mode is not None and mode & 0o077:
                out.append(f"{path} {mode:o}")
    return out


def _mode(path: str) -> int | None:
    """Permission bits, None for a file deleted since it was listed (a link the daemon consumed)."""
    try:
        return stat.S_IMODE(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def test_node_and_daemon_create_only_private_files_even_with_a_lax_umask(tmp_path: Path) -> None:
    """With umask 000, a node (WAL, archive, CDC links, page store, lock, control socket) and a daemon (state, lock,
    jsonl output) create files readable by their owner only and directories 0700."""
    node_dir = tmp_path / "node"
    old = os.umask(0)
    try:
        make_node(node_dir, segments=3, tx_per_segment=20)
        out = tmp_path / "private" / "events.jsonl"
        out.parent.mkdir(mode=0o700)
        config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out))
        proc = start_daemon(config, tmp_path / "daemon.err")
        try:
            wait_for(lambda: (out.exists() and out.stat().st_size > 0) or proc.poll() is not None, 60, "delivery")
            with Node.open(node_dir, wal_force_archive_timeout_ms=0) as node:
                assert (node_dir / "control.sock").exists()
                problems = private_problems(node_dir) + private_problems(out.parent)
                node.cache("late").put(1, {"v": 1})
        finally:
            assert stop_daemon(proc) == 0, (tmp_path / "daemon.err").read_text()[-2000:]
    finally:
        os.umask(old)
    assert problems == []
    assert private_problems(node_dir) == []


def test_secrets_are_masked_in_logs_error_lines_and_state_show(tmp_path: Path) -> None:
    """A consumer config with a token and a password-bearing URL, whose start() fails quoting that URL: exit 4, and
    neither secret appears in the log lines, the error line or `cdcd state show` (text and --json)."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=5)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "leaky.py").write_text(PLUGIN)
    url = f"postgresql://app:{SECRET_PASSWORD}@db.internal:5432/lake?password={SECRET_PASSWORD}&sslmode=require"
    consumer = {"kind": "python", "class": "leaky:Leaky", "options": {"token": SECRET_TOKEN, "url": url}}
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, consumer)
    err = tmp_path / "daemon.err"
    rc = run_daemon_until_exit(config, err, env=child_env(plugins))
    text = err.read_text()
    assert rc == 4, text[-2000:]
    lines = error_lines(err)
    assert len(lines) == 1 and "cannot reach postgresql://app:***@db.internal" in lines[0], lines
    assert SECRET_PASSWORD not in text and SECRET_TOKEN not in text

    shown = cdcd("state", "show", "--config", str(config), env=child_env(plugins))
    as_json = cdcd("state", "show", "--config", str(config), "--json", env=child_env(plugins))
    assert shown.returncode == 0 and as_json.returncode == 0, shown.stderr + as_json.stderr
    for out in (shown.stdout, as_json.stdout):
        assert SECRET_PASSWORD not in out and SECRET_TOKEN not in out
    options = json.loads(as_json.stdout)["consumer"]["options"]
    assert options["token"] == "***" and options["url"].startswith("postgresql://app:***@db.internal")
    assert "password=***&sslmode=require" in options["url"]


def test_control_status_masks_the_realtime_consumer_config(tmp_path: Path) -> None:
    """`cdcd control status` (text and --json) shows the node's realtime consumer with its secrets masked."""
    node_dir = tmp_path / "node"
    consumer = {"kind": "python", "class": "leaky:Leaky", "options": {"token": SECRET_TOKEN, "fail": False}}
    with Node.open(node_dir, realtime_consumer=consumer) as node:
        assert node.status()["realtime_consumer"]["options"]["token"] == "***"
        text = cdcd("control", "--node-dir", str(node_dir), "status")
        as_json = cdcd("control", "--node-dir", str(node_dir), "status", "--json")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    assert SECRET_TOKEN not in text.stdout + as_json.stdout
    assert json.loads(as_json.stdout)["realtime_consumer"] == {
        "kind": "python",
        "class": "leaky:Leaky",
        "options": {"token": "***", "fail": False},
    }
    assert '"token":"***"' in text.stdout


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(addr)
    return found


def test_metrics_listen_on_loopback_by_default(tmp_path: Path) -> None:
    """Without metrics_address in its config, `cdcd run` serves metrics on 127.0.0.1 only."""
    host, _, port_text = DaemonConfig(node_dir="x").metrics_address.rpartition(":")
    assert host == "127.0.0.1"
    port = int(port_text)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port} is taken on this machine")
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=1, tx_per_segment=5)
    config = tmp_path / "cdcd.toml"
    config.write_text(f'node_dir = "{node_dir}"\ncheck_interval_ms = 50\n[consumer]\nkind = "null"\n')
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err)
    try:
        wait_for(lambda: listening_addresses(port) or proc.poll() is not None, 60, "the metrics listener")
        assert proc.poll() is None, err.read_text()[-2000:]
        assert listening_addresses(port) == {"0100007F"}, "127.0.0.1 only (little-endian hex in /proc/net/tcp)"
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-2000:]
