"""The node's control socket: newline-delimited JSON over a Unix socket, owner only.

Requests: ``{"cmd": "realtime", "state": "on"|"off"}``, ``{"cmd": "cdc", "state": "on"|"off"}``,
``{"cmd": "status"}``,
``{"cmd": "resend", "cache": NAME}``, ``{"cmd": "digest"}`` (rows and checksum per cache).
Every request gets one JSON line back:
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``; a bad request never closes the server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import structlog

from cdcd.config import ConfigError

log = structlog.get_logger("cdcd.control")

MAX_REQUEST_BYTES = 64 * 1024
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlError(Exception):
    """A request the node refuses; the message goes back to the client."""


class ControlSocketInUse(ConfigError):
    """Another live process serves the configured control socket (two nodes given one path)."""


def _live_server_pid(path: Path) -> int | None:
    """The pid of the process serving ``path``, or None if nothing answers there (a leftover)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            with _short_path(path) as connect_path:
                probe.connect(connect_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        return _peer_creds(probe)[0]


@contextlib.contextmanager
def _short_path(path: Path) -> Iterator[str]:
    """Unix socket paths are limited to ~108 bytes: reach deep directories through /proc/self/fd."""
    if len(os.fsencode(path)) < 100:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid), int(uid), int(gid)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False
    dispatch: Handler


class _RequestHandler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        _pid, uid, _gid = _peer_creds(self.request)
        if uid not in (os.geteuid(), 0):
            log.warning("control_refused", peer_uid=uid)
            # Read the request first: closing with it unread makes the client's send fail
            # (EPIPE) before it can read the refusal.
            self.request.settimeout(5.0)
            with contextlib.suppress(OSError):
                self.rfile.readline(MAX_REQUEST_BYTES + 1)
            self._reply({"ok": False, "error": f"uid {uid} is not the node's owner"})
            return
        while True:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_REQUEST_BYTES:
                self._reply({"ok": False, "error": f"request over {MAX_REQUEST_BYTES} bytes"})
                return
            self._reply(self._handle_line(line))

    def _handle_line(self, line: bytes) -> dict[str, Any]:
        # UTF-8 first, with Python's decoder: it names the byte, and msgspec's own error for it differs between
        # releases (its type and its words).
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return {"ok": False, "error": f"bad request: invalid UTF-8 at byte {exc.start}"}
        try:
            request = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            return {"ok": False, "error": f"bad request: not JSON ({exc})"}
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return {"ok": False, "error": 'bad request: expected {"cmd": ...}'}
        try:
            return {"ok": True, **self.server.dispatch(request)}
        except ControlError as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # the node keeps serving; the client learns what went wrong
            log.error("control_command_failed", cmd=request.get("cmd"), error=f"{type(exc).__name__}: {exc}")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def _reply(self, reply: dict[str, Any]) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(msgspec.json.encode(reply) + b"\n")
            self.wfile.flush()


class ControlServer:
    """Serves ``dispatch`` on ``path`` (mode 0600) from a background thread; ``stop()`` is idempotent."""

    def __init__(self, path: Path, dispatch: Handler) -> None:
        self.path = path
        self._dispatch = dispatch
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._inode: int | None = None

    def check_free(self) -> None:
        """Raise ControlSocketInUse if another live process serves the path.

        The node's dir lock does not cover a control_socket configured outside its dir: another
        node may serve this path. Only a socket nobody answers on is a leftover to replace."""
        if self.path.exists() or self.path.is_symlink():
            pid = _live_server_pid(self.path) if self.path.is_socket() else None
            if pid is not None:
                raise ControlSocketInUse(
                    f"control_socket {self.path} is served by another live process (pid {pid}); "
                    "give each node its own control_socket"
                )

    def start(self) -> None:
        self.check_free()
        self.path.unlink(missing_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        with _short_path(tmp) as bind_path:
            server = _Server(bind_path, _RequestHandler, bind_and_activate=False)
            server.dispatch = self._dispatch
            server.server_bind()
        os.chmod(tmp, 0o600)  # before anyone can find it under its real name
        os.replace(tmp, self.path)
        self._inode = os.stat(self.path).st_ino
        server.server_activate()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="cdcd-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
        # Remove the socket only if it is still ours: never another node's at the same path.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()


def request(path: Path, message: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request to a node's control socket and return its reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        with _short_path(path) as connect_path:
            sock.connect(connect_path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A server that refuses us may close before reading all of it: its reply is still there.
            sock.sendall(msgspec.json.encode(message) + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    reply: dict[str, Any] = msgspec.json.decode(data)
    return reply


class ControlReplyError(OSError):
    """A reply that is not one JSON line within the size limit (``request_within``)."""


def request_within(path: Path, message: dict[str, Any], *, deadline_s: float, max_bytes: int) -> Any:
    """``request`` for read-only watchers (``cdcd top``): the whole exchange (connect, send, the reply
    up to its newline) ends within ``deadline_s`` and reads at most ``max_bytes``. A per-recv timeout
    would not do: a server sending one byte a second resets it forever.

    Returns the decoded JSON, whatever its shape (the caller checks it). Raises TimeoutError past the
    deadline, ControlReplyError for a reply over ``max_bytes``, cut short or not JSON, other OSErrors
    as ``socket`` does (FileNotFoundError, ConnectionRefusedError: nobody serves the path)."""
    deadline = time.monotonic() + deadline_s
    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(deadline_s)
            with _short_path(path) as connect_path:
                sock.connect(connect_path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # A server that refuses us may close before reading all of it: its reply is still there.
                sock.settimeout(max(1e-3, deadline - time.monotonic()))
                sock.sendall(msgspec.json.encode(message) + b"\n")
            while b"\n" not in data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                part = sock.recv(min(65536, max_bytes + 1 - len(data)))
                if not part:
                    break
                data += part
                if len(data) > max_bytes:
                    raise ControlReplyError(f"reply over {max_bytes} bytes without a newline")
    except TimeoutError:
        raise TimeoutError(f"no full reply within {deadline_s:g} s ({len(data)} bytes by then)") from None
    line, newline, _ = data.partition(b"\n")
    if not newline:
        raise ControlReplyError(f"closed after {len(data)} bytes of a reply" if data else "closed without a reply")
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError as exc:  # invalid UTF-8 included
        raise ControlReplyError(f"reply not JSON ({exc})") from None
