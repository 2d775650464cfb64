"""Where a process's CPU goes, by thread and by Python function, cheaply enough to run beside a benchmark.

Two readings: each thread's CPU seconds from ``/proc/self/task/<tid>/stat`` (exact, native work included: delta-rs's
tokio threads, pyarrow's pool), and a statistical split of each Python thread's busy time by function from stacks
sampled with ``sys._current_frames`` (a sample whose innermost frame waits - a condition, a sleep, a queue - is idle
and not counted; a thread inside a native call that holds no GIL counts as busy in the Python frame that called it).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

_IDLE = {
    ("threading.py", "wait"),
    ("threading.py", "wait_for"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("threading.py", "join"),
    ("queue.py", "get"),
    ("selectors.py", "select"),
    ("socketserver.py", "serve_forever"),
    ("thread.py", "_worker"),
}
"""Innermost frames of a thread that waits (by file name and function)."""
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """Native thread id -> (its name, user + system CPU seconds) for every thread of this process."""
    out: dict[int, tuple[str, float]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            comm = (task / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _where(frame: FrameType) -> tuple[str, str]:
    code = frame.f_code
    return (os.path.basename(code.co_filename), code.co_name)


class ThreadProfile:
    """Samples every ``every_s`` until ``stop()``; ``report()`` is the split as text."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._names: dict[int, str] = {}
        """Native thread id -> Python thread name (kept after the thread ends)."""
        self._busy: Counter[str] = Counter()
        self._samples: Counter[str] = Counter()
        self._inclusive: dict[str, Counter[tuple[str, str]]] = {}
        self._self: dict[str, Counter[tuple[str, str]]] = {}
        self._cpu0: dict[int, tuple[str, float]] = {}
        self._t0 = 0.0
        self._process0_s = 0.0
        self._thread = threading.Thread(target=self._run, name="thread-profile", daemon=True)

    def start(self) -> None:
        self._cpu0 = thread_cpu_s()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._process0_s = usage.ru_utime + usage.ru_stime
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every_s):
            by_ident = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = by_ident.get(ident)
                name = _group(thread.name if thread is not None else str(ident))
                if thread is not None and thread.native_id is not None:
                    self._names[thread.native_id] = name
                self._samples[name] += 1
                if _where(frame) in _IDLE or frame.f_code.co_name == "sleep":
                    continue
                self._busy[name] += 1
                self._self.setdefault(name, Counter())[_where(frame)] += 1
                seen: set[tuple[str, str]] = set()
                f: FrameType | None = frame
                while f is not None:
                    seen.add(_where(f))
                    f = f.f_back
                self._inclusive.setdefault(name, Counter()).update(seen)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        wall_s = time.monotonic() - self._t0
        cpu1 = thread_cpu_s()
        by_group: Counter[str] = Counter()
        for tid, (comm, cpu) in cpu1.items():
            before = self._cpu0.get(tid)
            used = cpu - (before[1] if before is not None and before[0] == comm else 0.0)
            name = self._names.get(tid) or _group(comm)
            by_group[name] += used
        usage = resource.getrusage(resource.RUSAGE_SELF)
        process_s = usage.ru_utime + usage.ru_stime - self._process0_s
        # Threads that ended before the end (a pool per batch) are gone from /proc: their CPU is the rest.
        by_group["(ended threads)"] += max(0.0, process_s - sum(by_group.values()))
        return {"wall_s": wall_s, "cpu_s": dict(by_group)}

    def report(self, cpu: dict[str, Any], entries: int, top: int = 25) -> str:
        lines = [f"wall {cpu['wall_s']:.1f} s, {entries:,} entries"]
        total = sum(cpu["cpu_s"].values())
        lines.append(f"process CPU {total:.1f} s = {total / max(entries, 1) * 1e6:.1f} us per entry")
        for name, s in sorted(cpu["cpu_s"].items(), key=lambda kv: -kv[1]):
            if s < 0.01:
                continue
            busy = self._busy.get(name, 0)
            n = self._samples.get(name, 0)
            lines.append(
                f"  thread {name:32s} {s:8.2f} CPU s  {s / max(entries, 1) * 1e6:7.1f} us/entry"
                f"  (busy in {busy}/{n} samples)"
            )
        for name, busy in self._busy.most_common():
            lines.append(f"\n== {name}: {busy} busy samples; inclusive / self share of them")
            inc = self._inclusive.get(name, Counter())
            own = self._self.get(name, Counter())
            for where, n in inc.most_common(top):
                lines.append(f"  {100 * n / busy:5.1f}%  {100 * own.get(where, 0) / busy:5.1f}%  {where[0]}:{where[1]}")
            lines.append("  -- self, top:")
            for where, n in own.most_common(12):
                lines.append(f"  {100 * n / busy:5.1f}%  {where[0]}:{where[1]}")
        return "\n".join(lines)


def _group(name: str) -> str:
    """Threads of one kind under one name (``Thread-12 (worker)`` and pool threads numbered apart)."""
    for prefix in ("tokio-runtime", "cdcd-lake-write", "ThreadPoolExecutor", "Thread-"):
        if name.startswith(prefix):
            return prefix
    return name.rstrip("0123456789_-") or name
