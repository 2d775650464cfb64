"""The node's replication endpoint: authenticates peers, decodes ``Apply`` frames, hands them to
the node, answers in order. A bad peer costs one error frame and its connection, never the node."""

from __future__ import annotations

import contextlib
import functools
import hmac
import queue
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable
from typing import Any

import structlog

from cdcd import metrics
from cdcd.replication.protocol import (
    PROTOCOL_VERSION,
    Applied,
    Apply,
    Drop,
    Error,
    Frame,
    Hello,
    ProtocolError,
    Welcome,
    decode_payload,
    encode_frame,
    read_payload,
)

log = structlog.get_logger("cdcd.replication")

ApplyFn = Callable[[Apply | Drop], tuple[Applied, Any]]
"""Applies a request without waiting for the WAL: the reply, and the WAL end to wait for (or None)."""
WaitFn = Callable[[Any], object]
MAX_STAGED_REPLIES = 16
"""Requests applied but not yet answered, per connection."""


class RequestRefused(Exception):
    """An Apply the node will not take (malformed entries); the peer gets the message."""


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = False  # server_close() joins the handlers: none may touch a closing node
    allow_reuse_address = True
    owner: ReplicationServer


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        owner = self.server.owner
        sock: socket.socket = self.request
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        if not owner._admit(sock):
            metrics.REPL_REFUSED.labels("connections").inc()
            _send(sock, Error(f"over replication_max_connections ({owner.max_connections})", fatal=True))
            return
        # One deadline for the whole handshake (TLS and hello): a per-read timeout would let a peer
        # dribbling a byte at a time hold a connection slot for ever.
        # The slot is the accepted socket's (``self.request``): ``sock`` is rebound once TLS wraps it.
        deadline = _HandshakeDeadline(
            sock, owner.auth_timeout_s, peer, release=functools.partial(owner._leave, self.request)
        )
        try:
            # The deadline decides; the socket timeout is only a backstop behind it.
            sock.settimeout(owner.auth_timeout_s + 5)
            if owner.tls is not None:
                try:
                    sock = owner.tls.wrap_socket(sock, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    if not deadline.passed():
                        metrics.REPL_REFUSED.labels("tls").inc()
                        log.warning("replication_tls_refused", peer=peer, error=str(exc))
                    return
            sender = self._authenticate(sock, peer)
            if not deadline.cancel() or sender is None:
                return
            sock.settimeout(None)
            log.info("replication_peer_connected", peer=peer, sender=sender)
            self._serve(sock, peer)
        except (ConnectionError, TimeoutError, ssl.SSLError, OSError) as exc:
            log.info("replication_peer_gone", peer=peer, error=f"{type(exc).__name__}: {exc}")
        finally:
            deadline.cancel()
            _drain_close(sock)
            owner._leave(self.request)

    def _authenticate(self, sock: socket.socket, peer: str) -> str | None:
        """The sender's description once its Hello is accepted; None after refusing it."""
        owner = self.server.owner
        try:
            payload = read_payload(sock, 64 * 1024)
            if payload is None:
                return None
            frame = decode_payload(payload)
        except ProtocolError as exc:
            self._refuse(sock, peer, "frame", f"bad hello: {exc}")
            return None
        if not isinstance(frame, Hello):
            self._refuse(sock, peer, "frame", f"expected hello, got {type(frame).__name__.lower()}")
        elif not hmac.compare_digest(frame.token.encode(), owner.token):
            self._refuse(sock, peer, "token", "replication token refused")
        elif frame.protocol != PROTOCOL_VERSION:
            self._refuse(sock, peer, "frame", f"protocol {frame.protocol} not supported (here: {PROTOCOL_VERSION})")
        else:
            _send(sock, owner.welcome)
            return f"cluster {frame.sender_cluster_id} node {frame.sender_node or '?'}"
        return None

    def _refuse(self, sock: socket.socket, peer: str, reason: str, message: str) -> None:
        _send(sock, self._refusal(peer, reason, message))

    def _refusal(self, peer: str, reason: str, message: str) -> Error:
        metrics.REPL_REFUSED.labels(reason).inc()
        log.warning("replication_peer_refused", peer=peer, reason=reason, error=message)
        return Error(message, fatal=True)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        """Apply requests as they come and answer them in order from a second thread, each once
        its WAL end is durable: the next request is applied while the previous one is flushed,
        and a pipelining sender gets every reply as early as it can."""
        replies: queue.Queue[tuple[Frame, Any] | None] = queue.Queue(MAX_STAGED_REPLIES)
        replier = threading.Thread(target=self._reply_loop, args=(sock, replies), name="cdcd-replication-replies")
        replier.start()
        try:
            self._read_loop(sock, peer, replies.put)
        finally:
            replies.put(None)
            replier.join()

    def _read_loop(self, sock: socket.socket, peer: str, reply: Callable[[tuple[Frame, Any]], None]) -> None:
        owner = self.server.owner
        while True:
            try:
                payload = read_payload(sock, owner.max_frame_bytes)
            except ProtocolError as exc:  # a lying length: the stream cannot be followed any more
                reply((self._refusal(peer, "frame", str(exc)), None))
                return
            if payload is None:
                return
            try:
                frame: Frame = decode_payload(payload)
            except ProtocolError as exc:  # framing is intact: answer and go on
                metrics.REPL_REFUSED.labels("frame").inc()
                log.warning("replication_bad_frame", peer=peer, error=str(exc))
                reply((Error(str(exc)), None))
                continue
            if not isinstance(frame, Apply | Drop):
                metrics.REPL_REFUSED.labels("frame").inc()
                reply((Error(f"unexpected {type(frame).__name__.lower()} frame"), None))
                continue
            try:
                reply(owner.apply(frame))
            except RequestRefused as exc:
                metrics.REPL_REFUSED.labels("request").inc()
                log.warning("replication_request_refused", peer=peer, cache=frame.cache, error=str(exc))
                reply((Error(str(exc), seq=frame.seq), None))
            except RuntimeError as exc:  # the node is closing or failed: the peer retries later
                reply((Error(str(exc), seq=frame.seq, fatal=True, retry=True), None))
                return

    def _reply_loop(self, sock: socket.socket, replies: queue.Queue[tuple[Frame, Any] | None]) -> None:
        failed = False
        while (item := replies.get()) is not None:
            if failed:
                continue  # keep taking items so the reader never blocks on a full queue
            frame, end = item
            if end is not None:
                try:
                    self.server.owner.wait_durable(end)
                except Exception as exc:  # the WAL failed: nothing from here on is confirmed
                    log.error("replication_flush_failed", error=f"{type(exc).__name__}: {exc}")
                    frame = Error(f"not durable: {exc}", seq=getattr(frame, "seq", 0), fatal=True, retry=True)
            _send(sock, frame)
            if isinstance(frame, Error) and frame.fatal:
                failed = True
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)  # the reader stops at once


class _HandshakeDeadline:
    """Shuts the connection down and frees its slot ``timeout_s`` after it was accepted unless cancelled first.

    It holds a duplicate of the socket's descriptor: TLS wrapping detaches the original socket
    object, and shutdown acts on the connection whichever descriptor names it."""

    def __init__(self, sock: socket.socket, timeout_s: float, peer: str, release: Callable[[], None]) -> None:
        self._dup: socket.socket | None = sock.dup()
        self._peer = peer
        self._release = release
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._expired = False
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._dup is None:
                return
            self._expired = True
            # Counted before the peer can see the connection go.
            metrics.REPL_REFUSED.labels("timeout").inc()
            error = f"no accepted hello within {self._timeout_s:g} s"
            log.warning("replication_peer_refused", peer=self._peer, reason="timeout", error=error)
            # The slot is free before the peer sees the connection go: the handler thread may
            # take a moment more to finish, and a real peer connecting next must not be refused.
            self._release()
            with contextlib.suppress(OSError):
                self._dup.shutdown(socket.SHUT_RDWR)
            self._dup.close()
            self._dup = None

    def cancel(self) -> bool:
        """True if the handshake finished in time (the deadline no longer applies)."""
        self._timer.cancel()
        with self._lock:
            if self._dup is not None:
                self._dup.close()
                self._dup = None
            return not self._expired

    def passed(self) -> bool:
        with self._lock:
            return self._expired


def _drain_close(sock: socket.socket) -> None:
    """End our side, then read (and drop) what the peer still sends for a moment: closing a socket
    with unread bytes sends a reset, which can destroy the error frame before the peer reads it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        budget = 1 << 20
        while budget > 0 and (part := sock.recv(65536)):
            budget -= len(part)


def _send(sock: socket.socket, frame: Frame) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(encode_frame(frame))


class ReplicationServer:
    """Serves the endpoint from background threads; ``stop()`` closes every connection, idempotent."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        token: bytes,
        apply: ApplyFn,
        wait_durable: WaitFn,
        welcome: Welcome,
        tls: ssl.SSLContext | None = None,
        max_frame_bytes: int,
        max_connections: int,
        auth_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self.token = token
        self.apply = apply
        self.wait_durable = wait_durable
        self.welcome = welcome
        self.tls = tls
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.auth_timeout_s = auth_timeout_s
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    def start(self) -> None:
        metrics.export(metrics.REPLICATION_ENDPOINT)
        host, _port = self.address
        _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = _Server(self.address, _Handler, bind_and_activate=True)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="cdcd-replication", daemon=True)
        self._thread.start()
        log.info("replication_listening", address=f"{host}:{self.port}", tls=self.tls is not None)

    def status(self) -> dict[str, Any]:
        with self._conns_lock:
            connections = len(self._conns)
        host = self.address[0]
        return {
            "listen": f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}",
            "tls": self.tls is not None,
            "client_certificates": self.tls is not None and self.tls.verify_mode == ssl.CERT_REQUIRED,
            "connections": connections,
        }

    def _admit(self, sock: socket.socket) -> bool:
        with self._conns_lock:
            if len(self._conns) >= self.max_connections or self._server is None:
                return False
            self._conns.add(sock)
            metrics.REPL_CONNECTIONS.set(len(self._conns))
            return True

    def _leave(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(sock)
            metrics.REPL_CONNECTIONS.set(len(self._conns))

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:  # wakes handlers blocked in recv; they end on the error
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        server.server_close()  # joins the handler threads
        if self._thread is not None:
            self._thread.join()
