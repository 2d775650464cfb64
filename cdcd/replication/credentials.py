"""The shared token and TLS contexts of both ends; every error names the config key."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from cdcd.config import ConfigError


def read_token(path: str, key: str, source: str) -> bytes:
    """The token in ``path``: a file only its owner may read (like ssh keys), stripped of whitespace."""
    if not path:
        raise ConfigError(f"{source}: key '{key}': required (a file holding the shared replication token)")
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"{source}: key '{key}': cannot open {p}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{source}: key '{key}': {p} is not a regular file")
        if mode & 0o077:
            raise ConfigError(
                f"{source}: key '{key}': {p} is readable by group or others "
                f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it"
            )
        token = f.read(4096).strip()
    if len(token) < 16:
        raise ConfigError(f"{source}: key '{key}': {p} holds {len(token)} bytes; use at least 16 random ones")
    try:
        token.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: key '{key}': {p} is not UTF-8 text") from None
    return token


def server_context(cert: str, key: str, ca: str, source: str) -> ssl.SSLContext | None:
    """TLS for the endpoint when ``cert`` is set; ``ca`` makes client certificates mandatory."""
    if not cert and not key and not ca:
        return None
    if not cert or not key:
        raise ConfigError(f"{source}: keys 'replication_tls_cert' and 'replication_tls_key' go together")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key, source, "replication_tls_cert")
    if ca:
        _load_ca(ctx, ca, source, "replication_tls_ca")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str, cert: str, key: str, source: str) -> ssl.SSLContext:
    """TLS for the sender: the server is verified (``ca``, or the system's CAs); a client
    certificate is presented when ``cert`` is set."""
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca:
        _load_ca(ctx, ca, source, "tls_ca")
    if cert or key:
        if not cert or not key:
            raise ConfigError(f"{source}: keys 'tls_cert' and 'tls_key' go together")
        _load_chain(ctx, cert, key, source, "tls_cert")
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, source: str, cert_key: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{source}: key '{cert_key}': cannot load {cert} / {key}: {exc}") from None


def _load_ca(ctx: ssl.SSLContext, ca: str, source: str, ca_key: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{source}: key '{ca_key}': cannot load {ca}: {exc}") from None
