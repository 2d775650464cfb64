"""Named crash points for fault-injection tests (the idea of FoundationDB's and TiKV's fail points).

``CDCD_FAILPOINTS="realtime.try_start_written,daemon.switch_committed@2"`` makes the process
SIGKILL itself when it reaches one of those points (``@N``: at the N-th time it gets there).
The environment is read once, at import; with the variable unset ``hit()`` is one dict lookup,
so points can sit on paths that run once per switch or commit (never per event).

A SIGKILL, not an exception: nothing may run after the point, exactly as if the machine died
there (no ``finally``, no atexit, no flush of buffered writes).
"""

from __future__ import annotations

import os
import signal

__all__ = ["hit"]


def _parse(text: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, nth = item.partition("@")
        points[name] = int(nth) if nth else 1
    return points


_armed = _parse(os.environ.get("CDCD_FAILPOINTS", ""))


def hit(name: str) -> None:
    """Die here if ``name`` is armed (and this is its N-th hit)."""
    if not _armed or name not in _armed:
        return
    _armed[name] -= 1
    if _armed[name] <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
