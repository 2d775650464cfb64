"""Scenario 4: the lake's file system fills up (a small tmpfs mounted for the lake), with a backlog and with a node
writing live. ``cdcd run`` with the lake sink (``kind = "lake"``, deltalake writer: no JVM) waits the full disk
out for its ``retry_timeout_s`` (2 s here), then must exit 4 with one ``cdcd: error:`` line naming the cause, its
state not past what the lake holds (and not behind it); readers must
never see a file the commit log does not name. After growing the file system (remount with a bigger size) a
restarted daemon lands every WAL entry exactly once: the change log, read with pyarrow, holds one row per WAL data
entry equal to it, no duplicates.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from tests.support.chaos import (
    ChaosFailure,
    Ctx,
    Result,
    archived_positions,
    check,
    check_lake_clean,
    lake_delivery,
    remount,
    rig,
    tmpfs,
    track,
)
from tests.support.delta_lake import check_state_matches_lake, landed_positions
from tests.support.lake import position, wait_caught_up, wait_started, write_config
from tests.support.procs import error_lines, start_daemon, stop_daemon
from tests.support.wal import archived_segments, wal_events
from tests.support.writer import make_node


def lake_consumer(lake: Path) -> dict[str, object]:
    # A full disk is waited out (a transient I/O error); 2 s of it here, so the scenario sees the exit.
    return {"kind": "lake", "lake_path": str(lake), "writer": "deltalake", "retry_timeout_s": 2}


def check_failure(err: Path, rc: int, lake: Path, config: Path, node_dir: Path) -> None:
    """Exit 4, one error line naming the full disk (last on stderr), state exactly where the lake ends."""
    text = err.read_text()
    lines = error_lines(err)
    check(rc == 4, f"daemon exit {rc} on a full lake, expected 4: {text[-1500:]}")
    check(len(lines) == 1, f"expected one error line, got {lines}")
    check(lines[0].startswith("cdcd: error: consumer on_events() failing for"), f"error line: {lines[0]}")
    check("No space left on device" in lines[0], f"the error line does not name the cause: {lines[0]}")
    check(text.rstrip("\n").splitlines()[-1] == lines[0], "something follows the error line on stderr")
    positions = archived_positions(node_dir)  # the node may be running: only what is archived
    check(bool(landed_positions(lake)), "no batch landed before the disk was full (tmpfs too small for the scenario)")
    after = position(config)
    try:
        sizes = Counter((p[0], p[1]) for p in positions)
        check_state_matches_lake(lake, positions, sizes, after)
    except AssertionError as exc:
        raise ChaosFailure(f"state vs lake after the failure: {exc}") from None
    check(after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "the failure was mid-backlog")


def backlog_round(ctx: Ctx, res: Result, k: int) -> None:
    tmp = ctx.episode_dir(f"backlog{k}")
    node_dir = tmp / "node"
    make_node(node_dir, segments=ctx.pick(12, 20), tx_per_segment=50)
    size = ctx.rng.choice(["192k", "256k", "320k"])
    batch = ctx.rng.choice([2000, 3000, 5000])
    with tmpfs(tmp / "mnt", size) as mnt:
        lake = mnt / "lake"
        config = write_config(tmp / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=batch)
        err = tmp / "run-1.err"
        proc = track(start_daemon(config, err))
        rc = proc.wait(180)
        check_failure(err, rc, lake, config, node_dir)
        remount(mnt, "size=256m")
        err2 = tmp / "run-2.err"
        proc = track(start_daemon(config, err2))
        try:
            wait_started(proc, err2)
            wait_caught_up(proc, config, node_dir, err2, 180)
        finally:
            rc = stop_daemon(proc, timeout=60)
        check(rc == 0, f"the daemon on the grown lake: exit {rc}: {err2.read_text()[-1500:]}")
        expected = wal_events(node_dir)
        d = lake_delivery(lake, expected)
        res.add(d)
        res.runs += 1
        d.check_clean(f"backlog round {k}")
        check_lake_clean(lake, expected)
        ctx.log(f"backlog round {k}: tmpfs {size}, batches of {batch}: {d.written} entries, {d.duplicates} duplicates")


def live_round(ctx: Ctx, res: Result, k: int) -> None:
    tmp = ctx.episode_dir(f"live{k}")
    size = ctx.rng.choice(["192k", "256k"])
    with tmpfs(tmp / "mnt", size) as mnt:
        lake = mnt / "lake"
        with rig(tmp, realtime_cdc=False, daemon_consumer=lake_consumer(lake)) as r:
            r.start_node(pause_ms=20)
            r.start_daemon()
            err = r.daemon_err
            rc = r.daemon_exit(120)
            check_failure(err, rc, lake, r.daemon_config, r.node_dir)
            time.sleep(ctx.rng.uniform(0.2, 1.0))  # the node keeps writing meanwhile
            remount(mnt, "size=256m")
            r.start_daemon()
            time.sleep(ctx.rng.uniform(0.3, 1.0))
            r.stop_node()
            r.wait_daemon_caught_up(timeout=180)
            r.stop_daemon()
            expected = wal_events(r.node_dir)
            d = lake_delivery(lake, expected)
            res.add(d)
            res.runs += 1
            d.check_clean(f"live round {k}")
            check_lake_clean(lake, expected)
            ctx.log(f"live round {k}: tmpfs {size}: {d.written} entries, {d.duplicates} duplicates")


def lake_disk_full(ctx: Ctx, res: Result) -> None:
    """The lake's tmpfs fills up: exit 4, one clear error, state not past the lake; grown, all lands exactly once."""
    res.duplicates_must_be_zero = True
    for k in range(ctx.pick(1, 2)):
        backlog_round(ctx, res, k)
    for k in range(ctx.pick(1, 2)):
        live_round(ctx, res, k)
