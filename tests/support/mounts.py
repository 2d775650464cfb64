"""File systems the fault tests mount: a tmpfs of a given size, remounted read-only or full."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    """``mount -o remount,OPTIONS`` (retried while a writer holds a file open: EBUSY for ro)."""
    deadline = time.monotonic() + 30
    while True:
        res = subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True, text=True)
        if res.returncode == 0:
            return
        assert time.monotonic() < deadline, res.stderr
        time.sleep(0.01)
