"""Chaos clock: on this PYTHONPATH, ``time.time`` and ``time.time_ns`` read the real wall clock plus an offset.

The offset (integer nanoseconds, may be negative) is the content of ``$CHAOS_CLOCK_FILE``, re-read every 10 ms
by a daemon thread, so a test can make the wall clock of a running process jump backwards or forwards. The
monotonic clock is untouched, as on a real machine whose clock is stepped. Without the variable nothing changes.
"""

from __future__ import annotations

import os
import threading
import time

_PATH = os.environ.get("CHAOS_CLOCK_FILE")


def _install(path: str) -> None:
    real_time_ns = time.time_ns
    offset = [0]

    def read() -> None:
        try:
            with open(path) as f:
                text = f.read().strip()
            offset[0] = int(text) if text else 0
        except (OSError, ValueError):
            pass  # mid-write or gone: keep the last offset

    def poll() -> None:
        while True:
            read()
            time.sleep(0.01)

    def time_ns() -> int:
        return real_time_ns() + offset[0]

    def time_s() -> float:
        return (real_time_ns() + offset[0]) / 1e9

    read()
    time.time_ns = time_ns
    time.time = time_s
    threading.Thread(target=poll, name="chaos-clock", daemon=True).start()


if _PATH:
    _install(_PATH)
