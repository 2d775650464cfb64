"""Durable file-system steps: fsync of a directory or a whole file system, atomic replacement of a small file."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a create, rename, link or unlink inside ``path`` survive a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make a file's data survive a crash (written by another library, e.g. Parquet)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


def sync_filesystem(path: Path) -> bool:
    """Flush every dirty file and directory of the file system holding ``path`` (Linux ``syncfs``):
    one call instead of an fsync per file when a batch wrote many. False where there is no syncfs
    (the caller fsyncs file by file)."""
    if _syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
    return True


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
