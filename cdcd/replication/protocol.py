"""The replication wire protocol: length-prefixed MessagePack frames over TCP (optionally TLS).

A frame is a 4-byte big-endian payload length followed by one tagged ``msgspec.Struct``. The
client speaks first with ``Hello`` (the shared token); then it sends ``Apply`` requests, each
answered in order by ``Applied`` or ``Error``. Requests may be pipelined: the server answers them
one by one, in the order they came. Schema rule as for WAL records: fields are only appended,
with defaults.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from cdcd.wal.records import CacheVersion, Op

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 << 20
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the message says what and where."""


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    token: str
    protocol: int = PROTOCOL_VERSION
    sender_cluster_id: int = 0
    sender_node: str = ""


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    cluster_id: int
    node_id: str
    protocol: int = PROTOCOL_VERSION
    max_frame_bytes: int = 0
    """The largest frame the target reads (its ``replication_max_frame_bytes``); 0: not told (an
    older target). A sender refuses an entry that cannot fit one, rather than send it in vain."""


class ReplEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One change as it left its origin cluster: ``version`` is the origin's version."""

    op: Op
    key: msgspec.Raw
    value: msgspec.Raw
    version: CacheVersion
    expire_time_ms: int = 0


class Apply(msgspec.Struct, frozen=True, tag="apply"):
    """Entries of one cache, in the origin's WAL order."""

    seq: int
    cache: str
    entries: list[ReplEntry]
    partitions: int = 0
    """The origin's partition count, used if the receiver has to create the cache."""


class Drop(msgspec.Struct, frozen=True, tag="drop"):
    """The origin dropped ``cache``: the receiver destroys it and rejects the origin's older entries
    of it from now on (``version``: the origin's version at the drop; None: only destroy). Answered
    by ``Applied`` (1 applied, or 1 duplicate for a drop it already made)."""

    seq: int
    cache: str
    version: CacheVersion | None = None


class Applied(msgspec.Struct, frozen=True, tag="applied"):
    seq: int
    applied: int
    rejected: int
    duplicates: int = 0
    """Entries already applied before (a re-sent batch after a retry): neither applied nor conflicts."""


class Error(msgspec.Struct, frozen=True, tag="error"):
    message: str
    seq: int = 0
    fatal: bool = False
    """True: the server closes the connection after this frame (bad token, broken framing)."""
    retry: bool = False
    """True: a passing state of the server (it is closing); the same request may succeed later."""


Frame = Hello | Welcome | Apply | Drop | Applied | Error

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    payload = _encoder.encode(frame)
    return _LEN.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Frame:
    try:
        frame: Frame = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"undecodable frame of {len(payload)} bytes: {exc}") from None
    return frame


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at a clean end of stream before the first byte."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            if not buf:
                return None
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def read_payload(sock: socket.socket, max_frame_bytes: int) -> bytes | None:
    """The next frame's payload; None at a clean end of stream. A length over ``max_frame_bytes``
    is a ProtocolError: the stream cannot be trusted after it."""
    head = recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > max_frame_bytes:
        raise ProtocolError(f"frame of {length} bytes is over the limit of {max_frame_bytes}")
    payload = recv_exact(sock, length)
    if payload is None:
        raise ConnectionError(f"connection closed before a frame of {length} bytes")
    return payload
