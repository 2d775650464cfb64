"""A node's replication endpoint in tests: raw exchanges, its token file, a target node listening."""

from __future__ import annotations

import contextlib
import socket
import struct
from pathlib import Path
from typing import Any

from cdcd.node.node import Node
from cdcd.replication.protocol import decode_payload


def exchange(port: int, data: bytes) -> list[Any]:
    """Send raw bytes to a replication endpoint; the frames it answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        with contextlib.suppress(OSError):  # the node may have answered and closed already
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while part := s.recv(65536):
            buf += part
    frames = []
    while buf:
        (size,) = struct.unpack(">I", buf[:4])
        frames.append(decode_payload(buf[4 : 4 + size]))
        buf = buf[4 + size :]
    return frames


TOKEN = "replication-token-0123456789abcdef"


def token_file(tmp: Path, text: str = TOKEN, mode: int = 0o600) -> Path:
    path = tmp / f"token-{len(list(tmp.glob('token-*')))}"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def open_target(tmp: Path, name: str = "b", cluster_id: int = 2, **settings: Any) -> Node:
    settings.setdefault("replication_token_file", str(token_file(tmp)))
    return Node.open(tmp / name, cluster_id=cluster_id, replication_listen="127.0.0.1:0", **settings)
