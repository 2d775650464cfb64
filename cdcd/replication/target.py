"""A replication target as configured: one options struct for every client of a node's replication
endpoint (the replication sink, ``cdcd kafka-to-node``), with the keys they share, checked and read
in one place."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from cdcd.config import ConfigError, convert, split_host_port
from cdcd.replication import credentials
from cdcd.replication.client import ReplicationClient


class TargetOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Keys of the table that names the target (flat, next to the client's own keys)."""

    target: str
    """host:port of the target node's ``replication_listen``."""
    token_file: str
    """File (mode 0600) holding the target's replication token."""
    tls: bool = False
    """Speak TLS (implied by any tls_* key)."""
    tls_ca: str = ""
    """CA bundle that signed the target's certificate (default: the system's CAs)."""
    tls_cert: str = ""
    tls_key: str = ""
    """Client certificate and key, for a target with ``replication_tls_ca``."""
    tls_server_name: str = ""
    """Name checked against the target's certificate (default: the target's host)."""

    def open(self, source: str) -> Target:
        """The address checked, the token read, the TLS context built: ConfigError naming ``source`` and
        the key otherwise."""
        try:
            address = split_host_port(self.target)
        except ValueError as exc:
            raise ConfigError(f"{source}: key 'target': {exc}") from None
        token = credentials.read_token(self.token_file, "token_file", source)
        tls: ssl.SSLContext | None = None
        if self.tls or self.tls_ca or self.tls_cert or self.tls_key:
            tls = credentials.client_context(self.tls_ca, self.tls_cert, self.tls_key, source)
        return Target(address, token, tls, self.tls_server_name)

    @classmethod
    def split(cls, options: Mapping[str, Any], source: str) -> tuple[TargetOptions, dict[str, Any]]:
        """A flat table's target keys as TargetOptions, and the other keys (for a struct that cannot
        inherit this one because it inherits another)."""
        mine = {k: v for k, v in options.items() if k in cls.__struct_fields__}
        return convert(mine, cls, source), {k: v for k, v in options.items() if k not in cls.__struct_fields__}


@dataclass(frozen=True)
class Target:
    """TargetOptions read: what a client needs to connect, and which caches go there."""

    address: tuple[str, int]
    token: bytes
    tls: ssl.SSLContext | None
    tls_server_name: str

    def client(
        self,
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
        max_in_flight: int = 4,
        sender_node: str = "",
    ) -> ReplicationClient:
        return ReplicationClient(
            self.address,
            self.token,
            tls=self.tls,
            tls_server_name=self.tls_server_name,
            sender_node=sender_node,
            connect_timeout_s=connect_timeout_s,
            request_timeout_s=request_timeout_s,
            max_in_flight=max_in_flight,
        )
