"""Named crash points for fault-injection tests (the idea of FoundationDB's and TiKV's fail points).

``CDCD_FAILPOINTS="realtime.try_start_written,daemon.switch_committed@2"`` makes the process
SIGKILL itself when it reaches one of those points (``@N``: at the N-th time it gets there).
The environment is read once, at import; with the variable unset ``hit()`` is one dict lookup,
so points can sit on paths that run once per switch or commit (never per event).

A SIGKILL, not an exception: nothing may run after the point, exactly as if the machine died
there (no ``finally``, no atexit, no flush of buffered writes).

``name[@N]=stop`` makes the process SIGSTOP itself there instead: a test holds it at that point
(its parent sees the stop through ``waitpid(pid, WUNTRACED)``, no polling), looks at what a reader
sees meanwhile, then lets it go on with SIGCONT.
"""

from __future__ import annotations

import os
import signal

__all__ = ["hit"]


ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _parse(text: str) -> dict[str, list[int]]:
    """``name[@N][=action]`` items -> name -> [hits left, signal]."""
    points: dict[str, list[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, action = item.partition("=")
        name, _, nth = point.partition("@")
        if (action or "kill") not in ACTIONS:
            raise ValueError(f"CDCD_FAILPOINTS: {item!r}: unknown action {action!r} (known: {', '.join(ACTIONS)})")
        points[name] = [int(nth) if nth else 1, ACTIONS[action or "kill"]]
    return points


_armed = _parse(os.environ.get("CDCD_FAILPOINTS", ""))


def hit(name: str) -> None:
    """Die (or stop) here if ``name`` is armed and this is its N-th hit."""
    if not _armed or name not in _armed:
        return
    point = _armed[name]
    point[0] -= 1
    if point[0] == 0:
        os.kill(os.getpid(), point[1])
