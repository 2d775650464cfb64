"""TCP ports for the tests' servers: below the kernel's ephemeral range and reserved across processes.

A server a test stops and starts again (a broker's outage, a node's restart, a daemon's metrics endpoint)
must get its port back. A port the kernel handed out with ``bind(0)`` lies in the ephemeral range: while the
server is down any outgoing connection on the machine may take it as its local port, and the restart fails
with "Address already in use". Ports here come from below that range, where only explicit binds land, and
each is reserved with a lock file the choosing process holds until it exits, so a parallel pytest worker
never picks a port another worker's stopped server still owns.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

_LOW = 10_000
_LOCKS = Path(tempfile.gettempdir()) / f"cdcd-test-ports-{os.getuid()}"
_held: dict[int, int] = {}
"""port -> the fd of its lock file, open (and so locked) for the life of this process."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _reserve(port: int) -> bool:
    if port in _held:
        return False
    _LOCKS.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(_LOCKS / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            os.close(fd)
            return False
    _held[port] = fd
    return True


def _release(port: int) -> None:
    os.close(_held.pop(port))


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports, all reserved for this process."""
    high = _ephemeral_low() - count
    rng = random.Random()
    for _ in range(10_000):
        first = rng.randrange(_LOW, max(_LOW + 1, high))
        taken: list[int] = []
        for port in range(first, first + count):
            if not _reserve(port):
                break
            taken.append(port)
        if len(taken) == count:
            return first
        for port in taken:
            _release(port)
    raise RuntimeError(f"no {count} consecutive free ports in {_LOW}..{high}")


def free_port() -> int:
    """A free port, reserved for this process (see the module's docstring)."""
    return free_ports(1)
