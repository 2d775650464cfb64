"""The sending side of the protocol: one authenticated connection, pipelined Apply requests."""

from __future__ import annotations

import collections
import socket
import ssl
import time
from collections.abc import Iterable, Mapping
from types import TracebackType

from cdcd import metrics
from cdcd.replication.protocol import (
    Applied,
    Apply,
    Drop,
    Error,
    Hello,
    ProtocolError,
    ReplEntry,
    Welcome,
    decode_payload,
    encode_frame,
    read_payload,
)
from cdcd.wal.records import CacheVersion


class TargetRefused(Exception):
    """The target answered with an error that retrying cannot fix (token, malformed request)."""


class TargetUnavailable(ConnectionError):
    """The target cannot take requests right now (closing, unreachable); retrying may help."""


class ReplicationClient:
    """``connect()`` once, then ``apply_all()`` as often as needed; any exception leaves the
    client disconnected (``connect()`` again). Not thread-safe."""

    def __init__(
        self,
        address: tuple[str, int],
        token: bytes,
        *,
        tls: ssl.SSLContext | None = None,
        tls_server_name: str = "",
        sender_cluster_id: int = 0,
        sender_node: str = "",
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
        max_in_flight: int = 4,
        max_frame_bytes: int = 64 << 20,
    ) -> None:
        self.address = address
        self._tls = tls
        self._server_name = tls_server_name or address[0]
        self._token_text = token.decode()
        self.sender_cluster_id = sender_cluster_id
        self.sender_node = sender_node
        """What the hello tells the target about us (its logs show it)."""
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_in_flight = max_in_flight
        self.max_frame_bytes = max_frame_bytes
        self._sock: socket.socket | None = None
        self._seq = 0
        self.welcome: Welcome | None = None

    @property
    def target(self) -> str:
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> Welcome:
        self.close()
        sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            sock.sendall(
                encode_frame(
                    Hello(self._token_text, sender_cluster_id=self.sender_cluster_id, sender_node=self.sender_node)
                )
            )
            reply = self._read(sock)
            if isinstance(reply, Error):
                raise TargetRefused(f"replication target {self.target} refused the connection: {reply.message}")
            if not isinstance(reply, Welcome):
                raise ProtocolError(f"replication target {self.target} answered hello with {type(reply).__name__}")
            sock.settimeout(self.request_timeout_s)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.welcome = reply
        return reply

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> ReplicationClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _read(self, sock: socket.socket) -> Welcome | Applied | Error:
        payload = read_payload(sock, self.max_frame_bytes)
        if payload is None:
            raise ConnectionError(f"replication target {self.target} closed the connection")
        frame = decode_payload(payload)
        if not isinstance(frame, Welcome | Applied | Error):
            raise ProtocolError(f"replication target {self.target} sent a {type(frame).__name__} frame")
        return frame

    def apply_all(
        self, requests: Iterable[tuple[str, list[ReplEntry]]], partitions: Mapping[str, int] | None = None
    ) -> Applied:
        """Send ``(cache, entries)`` requests, at most ``max_in_flight`` unanswered at a time;
        returns the summed replies once every request is answered. ``partitions``: the origin's
        partition count per cache, for a target that has to create it."""
        sock = self._sock
        if sock is None:
            raise ConnectionError(f"replication target {self.target}: not connected")
        in_flight: collections.deque[tuple[int, float]] = collections.deque()
        totals = [0, 0, 0]
        try:
            for cache, entries in requests:
                self._seq += 1
                data = encode_frame(Apply(self._seq, cache, entries, (partitions or {}).get(cache, 0)))
                if len(data) - 4 > self.max_frame_bytes:
                    raise TargetRefused(f"an apply request of {len(data)} bytes is over the frame limit")
                sock.sendall(data)
                in_flight.append((self._seq, time.perf_counter()))
                metrics.REPL_SENT_BYTES.inc(len(data))
                while len(in_flight) >= self.max_in_flight:
                    self._answer(sock, in_flight, totals)
            while in_flight:
                self._answer(sock, in_flight, totals)
        except BaseException:
            self.close()
            raise
        return Applied(self._seq, totals[0], totals[1], totals[2])

    def drop(self, cache: str, version: CacheVersion | None) -> Applied:
        """Tell the target its origin dropped ``cache`` (every earlier request answered first)."""
        sock = self._sock
        if sock is None:
            raise ConnectionError(f"replication target {self.target}: not connected")
        totals = [0, 0, 0]
        try:
            self._seq += 1
            sock.sendall(encode_frame(Drop(self._seq, cache, version)))
            self._answer(sock, collections.deque([(self._seq, time.perf_counter())]), totals)
        except BaseException:
            self.close()
            raise
        return Applied(self._seq, totals[0], totals[1], totals[2])

    def _answer(self, sock: socket.socket, in_flight: collections.deque[tuple[int, float]], totals: list[int]) -> None:
        seq, sent_at = in_flight.popleft()
        reply = self._read(sock)
        if isinstance(reply, Error):
            text = f"replication target {self.target}: {reply.message}"
            if reply.retry:
                raise TargetUnavailable(text)
            raise TargetRefused(text)
        if not isinstance(reply, Applied) or reply.seq != seq:
            raise ProtocolError(f"replication target {self.target}: reply out of order (expected {seq})")
        metrics.REPL_APPLY_SECONDS.observe(time.perf_counter() - sent_at)
        metrics.REPL_SENT_REQUESTS.inc()
        totals[0] += reply.applied
        totals[1] += reply.rejected
        totals[2] += reply.duplicates
