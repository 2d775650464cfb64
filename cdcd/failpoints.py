"""Named fail points for fault-injection tests (the idea of FoundationDB's and TiKV's fail points).

``CDCD_FAILPOINTS="realtime.try_start_written,daemon.switch_committed@2"`` makes the process
SIGKILL itself when it reaches one of those points (``@N``: at the N-th time it gets there).
``name=pause:DIR`` pauses there instead: the first process to get there (of all processes armed
with that DIR, once) creates ``DIR/name`` holding its pid and blocks until it is killed (at most
``PAUSE_MAX_S``), so a test can find and kill exactly that process at that point, e.g. a Spark
task between writing its files and returning them (``spark.executorEnv.CDCD_FAILPOINTS``).
The environment is read once, at import; with the variable unset ``hit()`` is one dict lookup,
so points can sit on paths that run once per switch, commit or task (never per event).

A SIGKILL, not an exception: nothing may run after the point, exactly as if the machine died
there (no ``finally``, no atexit, no flush of buffered writes).

``name[@N]=stop`` makes the process SIGSTOP itself there instead: a test holds it at that point
(its parent sees the stop through ``waitpid(pid, WUNTRACED)``, no polling), looks at what a reader
sees meanwhile, then lets it go on with SIGCONT.

``name[@N]=pause`` (no DIR) holds only the thread that gets there, while the process's other
threads go on (compaction merges two tables side by side: one pauses, the other commits): it
creates the file ``$CDCD_FAILPOINTS_DIR/<name>`` and waits until the test deletes it.

``name[@N]=raise`` raises ``FailpointRaised`` in the thread that gets there: a thread dying of an
exception nobody expected (the WAL flusher's, in ``tests/test_never_hangs.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FailpointRaised", "hit"]

ENV = "CDCD_FAILPOINTS"
PAUSE_MAX_S = 600.0
"""A paused process nobody killed goes on after this long (a test that failed must not leave it forever)."""


class FailpointRaised(RuntimeError):
    """What a point armed with ``raise`` raises."""


@dataclass
class _Point:
    left: int
    """Hits to go before it fires (1: the next one)."""
    action: str = "kill"
    """kill, stop, raise, pause (this thread, until ``$CDCD_FAILPOINTS_DIR/<name>`` is deleted) or
    pause:DIR (the first process of all, until killed)."""
    pause_dir: Path | None = None


def _parse(text: str) -> dict[str, _Point]:
    points: dict[str, _Point] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, _, action = item.partition("=")
        name, _, nth = spec.partition("@")
        point = _Point(int(nth) if nth else 1, action or "kill")
        if action.startswith("pause:") and action[len("pause:") :]:
            point.action, point.pause_dir = "pause_dir", Path(action[len("pause:") :])
        elif point.action not in ("kill", "stop", "raise", "pause"):
            raise ValueError(f"environment: {ENV}: {item!r}: the action is kill, stop, pause or pause:DIR (or raise)")
        points[name] = point
    return points


_armed = _parse(os.environ.get(ENV, ""))
_lock = threading.Lock()  # points hit from several threads count each hit once
_HOLD_POLL_S = 0.05


def _pause(name: str, where: Path) -> None:
    try:
        fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process holds this pause: this one goes on
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    threading.Event().wait(PAUSE_MAX_S)


def hit(name: str) -> None:
    """Die, stop, raise or pause here if ``name`` is armed and this is its N-th hit."""
    if not _armed or name not in _armed:
        return
    point = _armed[name]
    with _lock:
        point.left -= 1
        fire = point.left == 0
    if not fire:
        return
    if point.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif point.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif point.action == "raise":
        raise FailpointRaised(f"fail point {name}")
    elif point.pause_dir is not None:
        _pause(name, point.pause_dir)
    else:
        marker = os.path.join(os.environ["CDCD_FAILPOINTS_DIR"], name)
        with open(marker, "x"):
            pass
        while os.path.exists(marker):
            time.sleep(_HOLD_POLL_S)
