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

``name[@N]=pause`` holds only the thread that gets there, while the process's other threads go on
(compaction merges two tables side by side: one pauses, the other commits): it creates the file
``$CDCD_FAILPOINTS_DIR/<name>`` and waits until the test deletes it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["hit"]


PAUSE = 0
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "pause": PAUSE}
_PAUSE_POLL_S = 0.05


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
_lock = threading.Lock()  # points hit from several threads count each hit once


def hit(name: str) -> None:
    """Die (stop, pause) here if ``name`` is armed and this is its N-th hit."""
    if not _armed or name not in _armed:
        return
    point = _armed[name]
    with _lock:
        point[0] -= 1
        fire = point[0] == 0
    if not fire:
        return
    if point[1] != PAUSE:
        os.kill(os.getpid(), point[1])
        return
    marker = os.path.join(os.environ["CDCD_FAILPOINTS_DIR"], name)
    with open(marker, "x"):
        pass
    while os.path.exists(marker):
        time.sleep(_PAUSE_POLL_S)
