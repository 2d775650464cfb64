"""Hostile configs, environments and control requests: each gets one line naming the file or key
and exit 2 (or, on the control socket, a reply), never a traceback, and nonsense is never accepted
silently (issue 29 items 6 and 7)."""

from __future__ import annotations

import math
import os
import pwd
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.config import ConfigError, convert
from cdcd.control import ControlServer, request
from cdcd.daemon.config import NON_CONFIG_ENV, DaemonConfig, env_overrides, load_daemon_config
from cdcd.lake.sink import LakeOptions
from cdcd.node import Node, NodeConfig
from tests.support.procs import cdcd, child_env, start_daemon, stop_daemon, wait_for


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("cdcd: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def daemon_toml(path: Path, node_dir: str, consumer: str = 'kind = "null"', extra: str = "") -> Path:
    path.write_text(f'node_dir = "{node_dir}"\n{extra}\n[consumer]\n{consumer}\n')
    return path


# --- config files ------------------------------------------------------------------------------------
def test_a_config_path_that_is_a_directory_or_binary_is_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "cdcd.toml"
    binary.write_bytes(b"\x00\xff\xfe node_dir = 1\n\x80")
    for path, what in ((tmp_path, "is a directory"), (binary, "not a TOML file")):
        for args in (["run", "--config", str(path)], ["node", "run", "--config", str(path)]):
            proc = cdcd(*args)
            assert proc.returncode == 2, proc.stderr
            line = one_error_line(proc)
            assert str(path) in line and what in line, line


def test_empty_node_dir_is_a_config_error(tmp_path: Path) -> None:
    proc = cdcd("run", "--config", str(daemon_toml(tmp_path / "cdcd.toml", "")))
    assert proc.returncode == 2, proc.stderr
    assert "key 'node_dir': must not be empty" in one_error_line(proc)
    (tmp_path / "node.toml").write_text('node_dir = ""\n')
    proc = cdcd("node", "run", "--config", str(tmp_path / "node.toml"), "--seconds", "1")
    assert proc.returncode == 2, proc.stderr
    assert "key 'node_dir': must not be empty" in one_error_line(proc)


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("compact_interval_s = nan", "compact_interval_s"),
        ("compact_interval_s = inf", "compact_interval_s"),
        ("optimize_interval_s = -inf", "optimize_interval_s"),
        ("max_files_per_batch = 0", "max_files_per_batch"),
        (f"max_files_per_batch = {2**62}", "max_files_per_batch"),
    ],
)
def test_lake_numbers_out_of_range_are_refused(tmp_path: Path, setting: str, key: str) -> None:
    consumer = f'kind = "lake"\nlake_path = "{tmp_path / "lake"}"\nwriter = "deltalake"\n{setting}'
    config = daemon_toml(tmp_path / "cdcd.toml", str(tmp_path / "node"), consumer)
    proc = cdcd("run", "--config", str(config))
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert f"{key}'" in line and "key '" in line, line
    assert not (tmp_path / "lake").exists()


def test_non_finite_numbers_are_refused_for_every_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key 'batch_max_delay_ms'|key 'consumer_stall_timeout_ms'"):
        load_daemon_config(daemon_toml(tmp_path / "a.toml", "n", extra="consumer_stall_timeout_ms = nan"), environ={})
    with pytest.raises(ConfigError, match=r"^Node.open\(\): key 'ttl_expire_interval_ms'|not a finite"):
        Node.open(tmp_path / "node", ttl_expire_interval_ms=math.nan)


def test_a_control_socket_name_too_long_for_unix_addresses_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "node.toml").write_text(
        f'node_dir = "{tmp_path / "node"}"\ncontrol_socket = "{tmp_path / ("s" * 120)}"\n'
    )
    proc = cdcd("node", "run", "--config", str(tmp_path / "node.toml"), "--seconds", "1")
    assert proc.returncode == 2, proc.stderr
    assert "key 'control_socket'" in one_error_line(proc)


# --- the environment ----------------------------------------------------------------------------------
def test_documented_non_config_variables_are_accepted_and_unknown_ones_warned(tmp_path: Path) -> None:
    config = daemon_toml(tmp_path / "cdcd.toml", str(tmp_path / "node"))
    ignored: list[str] = []
    env = {name: "x" for name in NON_CONFIG_ENV} | {"CDCD_DEPLOY_COLOUR": "blue", "CDCD_BATCH_MAX_EVENTS": "7"}
    loaded = load_daemon_config(config, environ=env, ignored=ignored)
    assert loaded.batch_max_events == 7
    assert ignored == ["CDCD_DEPLOY_COLOUR"]
    # Through the CLI: the daemon starts and waits for its node (it does not exist here), past the variables.
    err = tmp_path / "daemon.err"
    proc = start_daemon(config, err, env=child_env() | {"CDCD_SPARK_JARS_DIR": "/x", "CDCD_DEPLOY_COLOUR": "b"})
    try:
        wait_for(lambda: b"waiting_for_node" in err.read_bytes() or proc.poll() is not None, 60, "the daemon")
    finally:
        assert stop_daemon(proc) == 0, err.read_text()[-2000:]
    text = err.read_text()
    assert "waiting_for_node" in text and "CDCD_SPARK_JARS_DIR" not in text
    assert "environment_variable_ignored" in text and "CDCD_DEPLOY_COLOUR" in text


def test_a_variable_one_typo_from_a_key_is_refused_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match="CDCD_BATCH_MAX_EVENT does not name a config key; did you mean CDCD_BATCH_MAX_EVENTS"
    ):
        env_overrides({"CDCD_BATCH_MAX_EVENT": "5"})


# --- control requests ---------------------------------------------------------------------------------
@pytest.fixture
def control(tmp_path: Path) -> Any:
    server = ControlServer(tmp_path / "control.sock", lambda req: {"echo": req["cmd"]})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def raw_exchange(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(data)
        out = b""
        while not out.endswith(b"\n"):
            part = sock.recv(65536)
            if not part:
                break
            out += part
        return out


def test_invalid_utf8_gets_a_reply_and_the_server_keeps_serving(control: ControlServer) -> None:
    for bad, at in ((b'{"cmd": "\xff"}\n', 9), (b'{"cmd": "status", "x": "\xc3"}\n', 24)):
        reply = msgspec.json.decode(raw_exchange(control.path, bad))
        assert reply == {"ok": False, "error": f"bad request: invalid UTF-8 at byte {at}"}
    assert request(control.path, {"cmd": "status"}) == {"ok": True, "echo": "status"}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_another_users_request_always_gets_the_refusal() -> None:
    """The socket is 0600; opened up here (in a directory ``nobody`` can reach) so another user's
    request reaches the owner check. The client is a forked child that drops to ``nobody`` and
    uses cdcd's own ``request``; before the fix most tries failed with BrokenPipeError."""
    with tempfile.TemporaryDirectory(prefix="cdcd-ctl-") as scratch:
        os.chmod(scratch, 0o755)
        server = ControlServer(Path(scratch) / "control.sock", lambda req: {"echo": req["cmd"]})
        server.start()
        try:
            os.chmod(server.path, 0o666)
            _refused_100_times(server.path)
        finally:
            server.stop()


def _refused_100_times(path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_fd)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            with os.fdopen(write_fd, "w") as out:
                try:
                    for _ in range(100):
                        reply = request(path, {"cmd": "status", "pad": "x" * 60000})
                        out.write(str(reply.get("error")) + "\n")
                    code = 0
                except Exception as exc:
                    out.write(f"{type(exc).__name__}: {exc}\n")
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as results:
        lines = results.read().splitlines()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, lines[-3:]
    assert lines == [f"uid {nobody.pw_uid} is not the node's owner"] * 100


# --- generated configs ----------------------------------------------------------------------------------
_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_config_values_never_raise_anything_but_a_config_error(data: st.DataObject) -> None:
    for cls, base in (
        (DaemonConfig, {"node_dir": "n", "consumer": {"kind": "null"}}),
        (NodeConfig, {"node_dir": "n"}),
        (LakeOptions, {"lake_path": "/tmp/lake"}),
    ):
        fields = sorted(set(cls.__struct_fields__) - {"node_dir", "lake_path"})
        keys = data.draw(st.lists(st.sampled_from(fields), max_size=3, unique=True))
        settings_ = base | {k: data.draw(_values) for k in keys}
        try:
            config = convert(settings_, cls, "generated")
        except ConfigError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("generated: ")
            continue
        for key in keys:
            value = getattr(config, key)
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)
            if isinstance(value, int) and not isinstance(value, bool):
                assert -(2**63) <= value < 2**63, (key, value)
