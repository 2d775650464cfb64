"""`cdcd lake compact` as a subprocess: its environment, its start in a process group of its own, its kill."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.support.lake import TEST_MASTER
from tests.support.procs import CDCD, child_env

QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""For the compactions run as subprocesses: a JVM without the C2 JIT starts about twice as fast."""


def compact_env(**extra: str) -> dict[str, str]:
    env = child_env()
    env["JAVA_TOOL_OPTIONS"] = QUICK_JVM
    env.update(extra)
    return env


def run_compact(lake: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*CDCD, "lake", "compact", "--lake", str(lake), "--spark-master", TEST_MASTER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # its JVM goes down with it (killpg)
    )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
