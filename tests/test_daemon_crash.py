"""Crash safety of the daemon: ``cdcd run`` SIGKILLed at random moments while the node keeps writing.

Each run of the daemon appends to one JSON-lines file; the test notes the file size and the
committed position (the daemon's LMDB state) after each kill, so the file splits into runs. Then:
every run delivers a contiguous stretch of the WAL's entries, in WAL order, each line equal to its
WAL entry; each restart begins exactly at the position committed before it, which is never past
what earlier runs wrote completely (so nothing is skipped and duplicates are only re-deliveries of
uncommitted batches); a SIGKILL may leave a partial last line (an unconfirmed batch); the union of
all runs is the whole WAL; and replaying the file in order gives the writer's final state.
"""

from __future__ import annotations

import bisect
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.support.config import jsonl_consumer, write_daemon_config
from tests.support.procs import committed, start_daemon, stop_daemon, wait_for, wait_progress
from tests.support.wal import archived_segments, cdc_links, wal_events
from tests.support.writer import CACHES, PUTS_PER_TX, expected_final_state, start_writer, writer_count, writer_progress

SEED = 104_6
MIN_ENTRIES = 50_000
"""The writer stops only once the WAL holds more entries than this (a volume, whatever the machine's speed)."""
DAEMON_SETTINGS: dict[str, Any] = {
    "batch_max_events": 300,
    "batch_max_delay_ms": 10,
    "check_interval_ms": 30,
    "read_chunk_records": 64,
    "queue_max_batches": 2,
}


@pytest.mark.slow
# The chaos scenario kill-daemon (make chaos) SIGKILLs `cdcd run` at random moments at length too.
@pytest.mark.parametrize("kills", [16, pytest.param(32, marks=pytest.mark.chaos)])
def test_daemon_sigkill_loop_delivers_everything_in_order(tmp_path: Path, kills: int) -> None:
    """SIGKILLing `cdcd run` 16 times (32 in make chaos) at random moments while the node writes loses nothing,
    re-delivers only uncommitted batches, and keeps WAL and per-key order."""
    rng = random.Random(SEED)
    node_dir = tmp_path / "node"
    out = tmp_path / "events.jsonl"
    config = write_daemon_config(tmp_path / "cdcd.toml", node_dir, jsonl_consumer(out), **DAEMON_SETTINGS)
    writer = start_writer(tmp_path, node_dir, count=0, pause_ms=100)  # ~5k entries/s until told to stop
    runs: list[dict[str, Any]] = []
    try:
        wait_for(lambda: (node_dir / "cdc").is_dir() or writer.poll() is not None, 30, "the node's cdc dir")
        for k in range(kills):
            err = tmp_path / f"daemon-{k}.err"
            start = out.stat().st_size if out.exists() else 0
            before = committed(config) if k else None
            proc = start_daemon(config, err)
            wait_for(lambda: b"daemon_started" in err.read_bytes() or proc.poll() is not None, 30, "daemon start")
            assert proc.poll() is None, err.read_text()[-2000:]
            time.sleep(rng.uniform(0, 0.6))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            runs.append({"start": start, "end": out.stat().st_size if out.exists() else 0, "before": before})
        assert writer.poll() is None, "the writer kept writing through every kill"
        # A volume, not a duration: every transaction writes PUTS_PER_TX entries at least.
        wait_for(lambda: writer_progress(tmp_path) * PUTS_PER_TX > MIN_ENTRIES, 300, f"{MIN_ENTRIES} entries written")
    finally:
        (tmp_path / "writer.stop").touch()
        assert writer.wait(60) == 0, (tmp_path / "writer.log").read_text()[-3000:]
    n_tx = writer_count(tmp_path)
    last = max(archived_segments(node_dir))

    # The final run catches up with everything and stops cleanly.
    err = tmp_path / "daemon-final.err"
    start = out.stat().st_size if out.exists() else 0
    before = committed(config)
    proc = start_daemon(config, err)
    try:
        # Started first: a killed run may already have committed the end, and a SIGTERM that arrives before the
        # daemon installed its handlers ends it by the signal's default action (-15), which is not this test's point.
        wait_for(
            lambda: proc.poll() is not None or b"daemon_started" in err.read_bytes(), 60, "the final daemon to start"
        )
        wait_progress(
            lambda: "exited" if proc.poll() is not None else committed_while_running(config),
            lambda pos: pos in ("exited", (last + 1, 0, 0)),
            60,
            f"the final daemon to commit {last + 1}:0#0",
        )
    finally:
        rc = stop_daemon(proc)
    assert rc == 0, err.read_text()[-3000:]
    runs.append({"start": start, "end": out.stat().st_size, "before": before, "final": True})
    assert committed(config) == (last + 1, 0, 0)
    assert cdc_links(node_dir) == {}

    expected = wal_events(node_dir)
    assert wal_events(node_dir, upto=last + 1) == expected
    positions = [tuple(e["pos"]) for e in expected]
    index = {p: i for i, p in enumerate(positions)}
    data = out.read_bytes()
    assert len(data) == runs[-1]["end"]
    frontier = 0  # entries 0..frontier-1 were written completely by some run
    resume_prev = 0
    replayed: dict[str, dict[str, Any]] = {c: {} for c in CACHES}
    stats = {"partial_lines": 0, "redelivered": 0, "runs_delivering": 0}
    for r, run in enumerate(runs):
        chunk = data[run["start"] : run["end"]]
        lines = chunk.split(b"\n")
        tail = lines.pop()  # b"" unless the run was killed in the middle of a line
        if tail:
            assert not run.get("final"), "the cleanly stopped run ends with a complete line"
            stats["partial_lines"] += 1
        before = run["before"]
        resume = bisect.bisect_left(positions, before) if before is not None else 0
        assert resume >= resume_prev, f"run {r}: the committed position went backwards"
        assert resume <= frontier, (
            f"run {r}: committed position {before} is past the last completely written entry "
            f"{positions[frontier - 1] if frontier else None}: entries would be lost"
        )
        resume_prev = resume
        idxs = []
        for line in lines:
            ev = json.loads(line)
            i = index.get(tuple(ev["pos"]))
            assert i is not None, f"run {r}: position {ev['pos']} is not a WAL data entry"
            assert ev == expected[i], f"run {r}: {ev} != {expected[i]}"
            idxs.append(i)
            key = json.dumps(ev["key"])
            if ev["op"] == "delete":
                replayed[ev["cache"]].pop(key, None)
            else:
                replayed[ev["cache"]][key] = ev["value"]
        if idxs:
            stats["runs_delivering"] += 1
            assert idxs[0] == resume, f"run {r} began at entry {idxs[0]}, its committed position says {resume}"
            assert idxs == list(range(idxs[0], idxs[0] + len(idxs))), f"run {r}: not a contiguous WAL stretch"
            stats["redelivered"] += max(0, frontier - idxs[0])
            frontier = max(frontier, idxs[-1] + 1)
    assert frontier == len(expected), f"{len(expected) - frontier} WAL entries were never delivered"
    assert replayed == expected_final_state(n_tx), "replaying the file in order does not give the writer's state"
    assert len(expected) > MIN_ENTRIES
    assert stats["runs_delivering"] >= kills // 2, stats  # kills landed while delivering, not only at startup
    print(f"\n{kills} kills, {len(expected)} entries, {last + 1} segments, {stats}")


def committed_while_running(config: Path) -> tuple[int, int, int] | str | None:
    """``committed`` while the daemon runs (its state exists by then: it was killed 32 times before)."""
    try:
        return committed(config)
    except lmdb.NotFoundError:  # the state-show startup race (see test_daemon_errors.py); cannot happen here
        return "unreadable"
