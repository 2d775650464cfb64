"""CPU seconds of a process from ``/proc/<pid>/stat``: what the benchmarks divide by entries."""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (``state`` is index 0, ``ppid`` 1): the name is
    cut at its last ``)``, as it may hold spaces and parentheses itself."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def cpu_s(pid: int, *, reaped_children: bool = False) -> float:
    """User + system CPU seconds of a running process, all its threads; with ``reaped_children`` also those of
    the children it has waited for (a live child is counted by its own entry, a reaped one in its parent's:
    never twice). Raises ``OSError`` when the process is gone."""
    fields = stat_fields(pid)
    ticks = sum(int(f) for f in fields[11 : 15 if reaped_children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")
