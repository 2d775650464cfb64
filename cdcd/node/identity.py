"""The node's id as a plain file in the node dir, for processes that must not open the node's LMDB.

The node keeps its id in its page store (created on first open) and writes it to
``<node_dir>/node_id`` at every open. The daemon checks segment headers and its own state
against it: a segment or a state of another node is an error, never delivered or acted on.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from cdcd.durable import fsync_dir
from cdcd.faults import ExitCode, Fault

NODE_ID_FILE = "node_id"


class BadNodeIdFile(Fault, ValueError):
    """``<node_dir>/node_id`` exists but does not hold a node id."""

    exit_code = ExitCode.BAD_STATE


def node_id_path(node_dir: str | Path) -> Path:
    return Path(node_dir) / NODE_ID_FILE


def write_node_id(node_dir: str | Path, node_id: uuid.UUID) -> None:
    """Record ``node_id`` in the node dir (atomically; nothing is written when it is already there)."""
    path = node_id_path(node_dir)
    try:
        if read_node_id(node_dir) == node_id:
            return
    except BadNodeIdFile:
        pass  # the node's page store is the source of truth: a damaged copy is replaced
    tmp = path.with_name(f".{NODE_ID_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # private, whatever the umask
    try:
        os.write(fd, f"{node_id}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_node_id(node_dir: str | Path) -> uuid.UUID | None:
    """The id the node in ``node_dir`` recorded, or None when it has not (never opened, or older)."""
    path = node_id_path(node_dir)
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    try:
        return uuid.UUID(text)
    except ValueError:
        raise BadNodeIdFile(f"{path}: not a node id: {text[:40]!r}") from None
