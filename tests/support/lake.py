"""The lake rig: the test process's Spark master, lake daemon configs and the daemon processes of the lake tests
(the reference checks of the Delta tables against the WAL are in ``tests.support.delta_lake``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import lmdb

from cdcd.daemon.config import load_daemon_config
from cdcd.daemon.ops import show_state
from tests.support.config import without_maintenance
from tests.support.procs import start_daemon, stop_daemon, wait_for
from tests.support.wal import archived_segments

Pos = tuple[int, int, int]
TEST_MASTER = "local[2]"
"""The test process's own SparkSession (reading the lake)."""
TEST_SPARK_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.databricks.delta.snapshotPartitions": "1",
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
}
"""Spark sized for the tests' tables of a few hundred rows on two cores. cdcd's own local-master sizes (more
partitions, for real tables) still run in every `cdcd lake` subprocess; in the tests' sessions each extra partition
is a task of scheduling, a Parquet writer and Delta statistics for a handful of rows, and the suite is CPU-bound."""
QUICK_START = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC", **TEST_SPARK_CONF}
"""For daemons and nodes that start often: a JVM without the C2 JIT starts (and runs its first job) about twice as
fast on a small machine."""


# --- configs and processes ------------------------------------------------------------------------
def toml_value(v: Any) -> str:
    """A TOML value; table keys are quoted (``"spark.driver.host" = ...`` must not become nested tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def write_config(path: Path, node_dir: Path, consumer: dict[str, Any], **settings: Any) -> Path:
    """A daemon TOML config: no metrics port, quick polling, ``settings`` on top, ``[consumer]``."""
    values: dict[str, Any] = {
        "node_dir": str(node_dir),
        "metrics_address": "",
        "lock_timeout_ms": 5000,
        "check_interval_ms": 50,
        "batch_max_delay_ms": 200,
        **settings,
    }
    lines = [f"{k} = {toml_value(v)}" for k, v in values.items()]
    lines.append("[consumer]")
    lines += [f"{k} = {toml_value(v)}" for k, v in without_maintenance(consumer).items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def position(config: Path) -> Pos | None:
    """The daemon's committed position, read in-process from its LMDB state (None: none yet or unreadable)."""
    try:
        parts = show_state(load_daemon_config(config, environ={}))["position_parts"]
    except lmdb.Error:  # a daemon starting for the first time has not created its databases yet
        return None
    return tuple(parts) if parts is not None else None


def wait_started(proc: subprocess.Popen[bytes], err: Path, timeout: float = 120) -> None:
    wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, timeout, "daemon start")
    assert proc.poll() is None, err.read_text()[-3000:]


def caught_up(node_dir: Path) -> Pos:
    """The position a daemon has once it delivered every archived segment."""
    return (max(archived_segments(node_dir)) + 1, 0, 0)


def wait_caught_up(proc: subprocess.Popen[bytes], config: Path, node_dir: Path, err: Path, timeout: float) -> None:
    until = caught_up(node_dir)
    wait_for(
        lambda: proc.poll() is not None or position(config) == until, timeout, f"the daemon to commit {until}", 0.25
    )
    assert proc.poll() is None, err.read_text()[-3000:]


def run_to_end(config: Path, node_dir: Path, err: Path, timeout: float = 300) -> None:
    """Start ``cdcd run``, let it deliver every archived segment, SIGTERM it: exit 0."""
    proc = start_daemon(config, err)
    try:
        wait_started(proc, err)
        wait_caught_up(proc, config, node_dir, err, timeout)
    finally:
        rc = stop_daemon(proc, timeout=60)
    assert rc == 0, err.read_text()[-3000:]


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants (the daemon's Spark JVM), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Wait until these processes ended (a killed daemon's JVM notices its parent's death by itself)."""
    wait_for(lambda: not any(running(p) for p in pids), timeout, f"processes {pids} to end")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("cdcd: error:")]
