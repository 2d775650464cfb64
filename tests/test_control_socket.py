"""The control socket belongs to one live node: a second node configured with the same path is
refused before it writes anything, and a node never removes a socket that is not its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cdcd.control import ControlSocketInUse, request
from cdcd.node.node import Node


def test_second_node_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    """Node B configured with node A's control_socket fails to open with one error naming the path
    and A's pid; B's WAL holds nothing; A keeps serving and removes its socket when it closes."""
    shared = tmp_path / "control.sock"
    a = Node.open(tmp_path / "a", control_socket=str(shared))
    try:
        with pytest.raises(ControlSocketInUse, match=rf"control_socket {shared} is served by .*pid {os.getpid()}"):
            Node.open(tmp_path / "b", control_socket=str(shared))
        assert not list((tmp_path / "b" / "wal").glob("*.wal")), "the refused node wrote to its WAL"
        assert request(shared, {"cmd": "status"})["ok"]
        # A node process gets the same answer as a one-line error and exit 2 (no restart loop).
        cfg = tmp_path / "b.toml"
        cfg.write_text(f'node_dir = "{tmp_path / "b"}"\ncontrol_socket = "{shared}"\n')
        proc = subprocess.run(
            [sys.executable, "-m", "cdcd", "node", "run", "--config", str(cfg)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("cdcd: error:")]
        assert len(errors) == 1 and str(shared) in errors[0] and "Traceback" not in proc.stderr
        assert request(shared, {"cmd": "status"})["ok"]
    finally:
        a.close()
    assert not shared.exists()


def test_a_leftover_socket_is_replaced(tmp_path: Path) -> None:
    """A socket file nobody serves (a killed node's) does not stop the node from opening."""
    path = tmp_path / "n" / "control.sock"
    path.parent.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # bound, never listening, closed: what a SIGKILLed node leaves
    node = Node.open(tmp_path / "n")
    try:
        assert request(path, {"cmd": "status"})["ok"]
    finally:
        node.close()


def test_close_leaves_a_socket_that_is_not_its_own(tmp_path: Path) -> None:
    """If the path was replaced while the node ran, closing the node leaves the new socket alone."""
    node = Node.open(tmp_path / "n")
    path = tmp_path / "n" / "control.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path.unlink()
        other.bind(str(path))
        other.listen()
        node.close()
        assert path.is_socket()
    finally:
        other.close()
        node.close()
