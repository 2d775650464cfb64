"""Crash safety of the jsonl consumer's worker processes: ``cdcd run`` SIGKILLed while it catches up.

Batches of 20k events go through the workers (tasks of 4096 lines, the next batches prepared
ahead). The file splits into runs as in ``test_daemon_crash``: each run must deliver a contiguous
stretch of the WAL from the position committed before it (never past what earlier runs wrote
completely), each line equal to its WAL entry; the last run ends with the whole WAL. And the
workers of a killed daemon must be gone soon after it, without writing anything after it died
except the task they were writing at that moment (which continues the run's stretch).
"""

from __future__ import annotations

import bisect
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.daemon.config import load_daemon_config
from cdcd.daemon.ops import show_state
from tests.test_daemon_e2e import (
    archived_segments,
    jsonl_consumer,
    make_node,
    start_daemon,
    stop_daemon,
    wait_for,
    wal_events,
    write_daemon_config,
)

KILLS = 8
SEED = 7_2026


def committed(config: Path) -> tuple[int, int, int] | None:
    parts = show_state(load_daemon_config(config, environ={}))["position_parts"]
    return tuple(parts) if parts is not None else None


def worker_pids(cdc_dir: Path) -> list[int]:
    """Live jsonl worker processes reading ``cdc_dir`` (whoever their parent is now)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{entry.name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"cdcd.sinks.jsonl_workers" in args and os.fsencode(cdc_dir) in args and state != "Z":
            out.append(int(entry.name))
    return out


@pytest.mark.slow
def test_sigkill_during_worker_catch_up_loses_nothing(tmp_path: Path) -> None:
    """SIGKILLing `cdcd run` 8 times while its workers write a 400k-entry backlog loses nothing, re-delivers only
    uncommitted batches, keeps WAL order, and leaves no worker behind."""
    rng = random.Random(SEED)
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=16, tx_per_segment=500)
    out = tmp_path / "events.jsonl"
    settings: dict[str, Any] = {"batch_max_events": 20_000, "check_interval_ms": 50, "batch_max_delay_ms": 20}
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), **settings)
    cdc = node_dir / "cdc"
    last = max(archived_segments(node_dir))
    runs: list[dict[str, Any]] = []
    killed_while_workers_ran = 0
    for k in range(KILLS + 1):
        final = k == KILLS
        err = tmp_path / f"daemon-{k}.err"
        start = out.stat().st_size if out.exists() else 0
        before = committed(config) if k else None
        proc = start_daemon(config, err)
        wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 60, "daemon start")
        assert proc.poll() is None, err.read_text()[-2000:]
        if final:
            wait_for(lambda: proc.poll() is not None or committed(config) == (last + 1, 0, 0), 120, "the end")
            assert stop_daemon(proc) == 0, err.read_text()[-3000:]
        else:
            # Kill only once the workers are writing this run's output (a random moment after that):
            # a fixed sleep left it to machine load whether the kill landed mid-delivery.
            wait_for(
                lambda: proc.poll() is not None or (worker_pids(cdc) and out.exists() and out.stat().st_size > start),
                120,
                "the workers to deliver",
                interval=0.01,
            )
            assert proc.poll() is None, err.read_text()[-2000:]
            time.sleep(rng.uniform(0.0, 0.1))
            workers = worker_pids(cdc)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            killed_while_workers_ran += bool(workers) and committed(config) != (last + 1, 0, 0)
            wait_for(lambda: not worker_pids(cdc), 10, "the workers of the killed daemon to exit")
        runs.append({"start": start, "end": out.stat().st_size if out.exists() else 0, "before": before})
    assert committed(config) == (last + 1, 0, 0)
    assert killed_while_workers_ran >= KILLS // 2, "the kills did not land while workers were delivering"

    expected = wal_events(node_dir)
    positions = [tuple(e["pos"]) for e in expected]
    index = {p: i for i, p in enumerate(positions)}
    data = out.read_bytes()
    frontier = 0
    for r, run in enumerate(runs):
        lines = data[run["start"] : run["end"]].split(b"\n")
        tail = lines.pop()
        assert not tail or r < KILLS, "the cleanly stopped run ends with a complete line"
        resume = bisect.bisect_left(positions, run["before"]) if run["before"] is not None else 0
        assert resume <= frontier, f"run {r}: committed {run['before']} is past what was written: entries lost"
        idxs = []
        for line in lines:
            ev = json.loads(line)
            i = index[tuple(ev["pos"])]
            assert ev == expected[i], f"run {r}: {ev} != {expected[i]}"
            idxs.append(i)
        if idxs:
            assert idxs == list(range(resume, resume + len(idxs))), f"run {r}: not the WAL stretch from {resume}"
            frontier = max(frontier, idxs[-1] + 1)
    assert frontier == len(expected), f"{len(expected) - frontier} WAL entries were never delivered"
    assert len(expected) > 300_000
