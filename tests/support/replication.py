"""Raw exchanges with a node's replication endpoint."""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Any

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
