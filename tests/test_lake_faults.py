"""Fault injection on the Delta lake sink (DESIGN §7): ``cdcd run`` SIGKILLed at points of a batch commit under load,
an unwritable lake, a full disk.

Everything is checked against the WAL with the helpers of ``test_lake_delta.py``: after each fault the table
holds no entry twice and only whole records, the daemon's committed position is never past what the lake holds,
and after the fault is gone a clean run leaves exactly one row per WAL data entry. Files of a batch that never
committed are orphans no reader sees (Delta readers read the log) and ``vacuum`` removes them.

Kill points inside a commit are reached with ``KillingLake`` (the real LakeConsumer; its ChangeTable's methods
wrapped to SIGKILL the process at the chosen step); other kills hit the daemon from outside at random moments.
Mounting tmpfs file systems (read-only, tiny) needs root with CAP_SYS_ADMIN; those tests skip otherwise.
"""

from __future__ import annotations

import errno
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdcd.lake.landing.delta import app_id, decode_version
from tests.support.delta_lake import (
    check_lake,
    check_moment,
    check_state_matches_lake,
    lake_consumer,
    landed_positions,
    record_sizes,
)
from tests.support.lake import (
    error_lines,
    position,
    process_tree,
    run_to_end,
    wait_caught_up,
    wait_gone,
    wait_started,
    write_config,
)
from tests.support.mounts import remount, tmpfs
from tests.support.procs import child_env, log_events, reap, stop_daemon, wait_for
from tests.support.wal import archived_segments, cdc_links, wal_events
from tests.support.writer import make_node, start_writer

CDCD = [sys.executable, "-m", "cdcd"]
Pos = tuple[int, int, int]

KILL_PLUGIN = '''
"""The real LakeConsumer, SIGKILLing its own process at one step of its n-th batch commit."""
import json
import os
import signal
from pathlib import Path

from cdcd.lake.sink import LakeConsumer, LakeOptions


class KillingLake(LakeConsumer):
    def __init__(self, kill_at, kill_commit, marker, **options):
        super().__init__(LakeOptions(**{"compact_interval_s": 0.0, "optimize_interval_s": 0.0, **options}))
        self.kill_at = kill_at  # spark-written | files-written | committed
        self.kill_commit = kill_commit  # the n-th batch of this process (1-based)
        self.marker = Path(marker)
        self.batches = 0  # commits
        self.writes = 0  # Spark jobs: one batch may be written before the one ahead of it commits (write_ahead_max_s)

    def _die(self, **info):
        self.marker.write_text(json.dumps({"at": self.kill_at, **info}))
        os.kill(os.getpid(), signal.SIGKILL)

    def start(self, registry=None):
        super().start(registry)
        table = self._table
        commit = table.commit
        def hooked_commit(**kw):
            self.batches += 1
            mine = self.batches == self.kill_commit
            if mine and self.kill_at == "files-written":  # files fsynced in the table, not committed
                self._die(files=[a.path for a in kw["files"].adds])
            ok = commit(**kw)
            if ok and mine and self.kill_at == "committed":  # committed, the daemon not told
                self._die(last=str(kw["last"]), source=kw["source"], generation=kw["generation"])
            return ok

        table.commit = hooked_commit

    def _write_on_spark(self, table, parts, info):
        written = super()._write_on_spark(table, parts, info)
        self.writes += 1
        # The Spark tasks wrote the n-th batch into the table; nothing of it is committed.
        if self.kill_at == "spark-written" and self.writes == self.kill_commit:
            self._die(files=[a.path for a in written.adds])
        return written
'''

SEED = 15_019
IN_PROCESS = ("spark-written", "files-written", "committed")


# --- helpers ---------------------------------------------------------------------------------------
def start(config: Path, err: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with err.open("ab") as f:
        return subprocess.Popen(
            [*CDCD, "run", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=f, env=env or child_env()
        )


def archived_events(node_dir: Path) -> list[dict[str, Any]]:
    """``wal_events`` of the archive only (a live node moves its active segment away under a reader)."""
    import tests.support.wal as e2e
    from cdcd.wal import WalReader

    real = e2e.wal_records
    e2e.wal_records = lambda d: WalReader([d / "wal" / "archive"])
    try:
        return wal_events(node_dir)
    finally:
        e2e.wal_records = real


def log_event_names(err: Path) -> list[str]:
    return [json.loads(line)["event"] for line in err.read_text().splitlines() if line.startswith("{")]


def orphans(lake: Path) -> set[str]:
    """Parquet files under changes/ that the table does not name (a reader of the table never sees them)."""
    changes = lake / "changes"
    on_disk = {str(p.relative_to(changes)) for p in changes.rglob("*.parquet") if "_delta_log" not in p.parts}
    live = pa.table(DeltaTable(str(changes)).get_add_actions(flatten=True)).column("path").to_pylist()
    return on_disk - set(live)


# --- SIGKILL at points of a batch commit --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1800)
# make test kills at each commit point once per writer; make chaos adds four kills at random moments (and the chaos
# scenario kill-daemon-lake repeats random kills at length).
@pytest.mark.parametrize("at_random", [False, pytest.param(True, marks=pytest.mark.chaos)])
def test_sigkill_during_commits_lands_everything_exactly_once(tmp_path: Path, at_random: bool) -> None:
    """SIGKILLing `cdcd run` 5 times (9 in make chaos) while it works through a backlog - after Spark tasks wrote
    a batch into the table, with a batch's files fsynced in the table but not committed, right after a commit the
    daemon was not told of, and (make chaos) at random moments - with both writers taking turns on one table, never
    shows a reader an entry twice or half a record, never commits the daemon past the lake, and a final clean run
    leaves every WAL entry in the table exactly once; `vacuum` then removes exactly the orphaned files of the
    uncommitted batches."""
    rng = random.Random(SEED)
    t0 = time.monotonic()
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=8, tx_per_segment=50)  # a backlog of ~20k entries, then live load
    load = start_writer(tmp_path, node_dir, pause_ms=400)  # ~25 transactions (~1k entries) a second
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "lake_kill.py").write_text(KILL_PLUGIN)
    env = child_env(plugins)
    settings = {"batch_max_events": 2000, "batch_max_delay_ms": 300}
    # Every commit point once per writer (spark-written is the Spark writer's alone).
    phases = [("spark-written", "spark")]
    phases += [(p, w) for p in ("files-written", "committed") for w in ("spark", "deltalake")]
    if at_random:
        phases += [("random", "spark"), ("random", "deltalake"), ("random", "deltalake")]
        phases += [(rng.choice(IN_PROCESS[1:]), "deltalake")]
    rng.shuffle(phases)
    marker = tmp_path / "killed.json"
    runs: list[dict[str, Any]] = []
    orphaned: set[str] = set()
    try:
        for k, (phase, writer) in enumerate(phases):
            err = tmp_path / f"daemon-{k}.err"
            options = lake_consumer(lake, writer, app_name=f"cdcd-kill-{k}")
            if phase in IN_PROCESS:
                table = {"kind": "python", "class": "lake_kill:KillingLake"}
                table["options"] = {"kill_at": phase, "kill_commit": rng.randint(1, 2), "marker": str(marker)}
                table["options"].update({key: v for key, v in options.items() if key != "kind"})
                options = table
            config = write_config(tmp_path / "cdcd.toml", node_dir, options, **settings)
            before = position(config)
            proc = start(config, err, env)
            wait_started(proc, err)
            jvm = process_tree(proc.pid)
            assert bool(jvm) == (writer == "spark"), "only the Spark writer runs a JVM under the daemon"
            if phase == "random":
                landed = len(landed_positions(lake))
                # Under way: at least one batch of this run landed, then a random moment of the next ones.
                wait_for(lambda n=landed: len(landed_positions(lake)) > n or proc.poll() is not None, 180, "a batch")
                time.sleep(rng.uniform(0, 1.5))
                proc.send_signal(signal.SIGKILL)
            rc = proc.wait(300)
            assert rc == -signal.SIGKILL, f"run {k} ({phase}): exit {rc}\n" + err.read_text()[-3000:]
            wait_gone(jvm)
            info: dict[str, Any] = {"phase": phase, "writer": writer, "before": before, "after": position(config)}
            if phase in IN_PROCESS:
                assert marker.exists(), f"run {k}: the {phase} hook did not fire"
                info |= json.loads(marker.read_text())
                marker.unlink()
            runs.append(info)

            now = archived_events(node_dir)
            check_moment(lake, [tuple(e["pos"]) for e in now], record_sizes(now), info["after"])
            assert info["after"] is None or before is None or info["after"] >= before
            if phase in ("files-written", "spark-written"):
                assert info["files"] and set(info["files"]) <= orphans(lake), "fsynced, in the table dir, not committed"
                orphaned |= set(info["files"])
            elif phase == "committed":
                dt = DeltaTable(str(lake / "changes"))
                version = dt.transaction_version(app_id(info["source"], info["generation"]))
                assert version is not None and str(decode_version(version)) == info["last"], "the commit landed"
                assert info["after"] is None or info["after"][:2] <= tuple(map(int, info["last"].split(":")))
    finally:
        (tmp_path / "writer.stop").touch()
        load.wait(120)

    # The load stops; the final run, with the plain config, catches up and stops cleanly.
    (tmp_path / "writer.stop").touch()
    assert load.wait(120) == 0
    expected = wal_events(node_dir)
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), **settings)
    final_err = tmp_path / "daemon-final.err"
    run_to_end(config, node_dir, final_err)
    assert position(config) == (max(archived_segments(node_dir)) + 1, 0, 0)
    assert cdc_links(node_dir) == {}
    check_lake(lake, node_dir, expected)

    # Each run after a kill past the commit point re-delivered that batch, and the lake dropped it.
    for k, prev in enumerate(runs, start=1):
        err = tmp_path / (f"daemon-{k}.err" if k < len(runs) else "daemon-final.err")
        if prev["phase"] == "committed":
            assert "lake_replay_dropped" in log_event_names(err), f"run {k} after a kill at {prev['phase']}"
    assert orphaned and orphaned <= orphans(lake)
    removed = DeltaTable(str(lake / "changes")).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False, full=True
    )
    assert orphans(lake) == set()
    assert {str(Path(p)) for p in removed} >= orphaned
    check_lake(lake, node_dir, expected)
    counts = Counter(f"{r['phase']}/{r['writer']}" for r in runs)
    print(f"\n{len(runs)} kills {dict(counts)}, {len(expected)} entries, {time.monotonic() - t0:.0f}s")


# --- an unwritable lake ------------------------------------------------------------------------------
def test_unwritable_lake_exits_4_then_lands_everything_once(tmp_path: Path) -> None:
    """A lake on a read-only mount or below a regular file: `cdcd run` exits 4 with one error line naming the path and
    leaves its state alone; a lake turning read-only mid-run: retried as an I/O error for retry_timeout_s (3 s
    here), then exit 4, state exactly where the lake ends; once writable again a restarted daemon lands every
    entry exactly once."""
    node_dir = tmp_path / "node"
    n = make_node(node_dir, segments=8, tx_per_segment=40)
    settings = {"batch_max_events": 3000}
    with tmpfs(tmp_path / "mnt", "ro,size=64m") as mnt:
        lake = mnt / "lake"
        # 1. read-only from the start: fails in start().
        config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake, retry_timeout_s=3), **settings)
        res = subprocess.run([*CDCD, "run", "--config", str(config)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 4, res.stderr[-3000:]
        assert error_lines(res.stderr) == [
            f"cdcd: error: consumer start() raised OSError: [Errno {errno.EROFS}] lake_path {lake}: "
            "not writable (Read-only file system)"
        ]
        assert res.stderr.rstrip("\n").splitlines()[-1].startswith("cdcd: error:")
        assert position(config) is None, "the daemon's state did not move"
        assert sorted(cdc_links(node_dir)) == sorted(archived_segments(node_dir)), "no link consumed"
        # 2. below a regular file.
        afile = tmp_path / "a-file"
        afile.write_text("not a directory\n")
        bad = write_config(tmp_path / "bad.toml", node_dir, lake_consumer(afile / "lake"), **settings)
        res = subprocess.run([*CDCD, "run", "--config", str(bad)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 4, res.stderr[-3000:]
        assert error_lines(res.stderr) == [
            "cdcd: error: consumer start() raised NotADirectoryError: "
            f"[Errno {errno.ENOTDIR}] lake_path {afile / 'lake'}: Not a directory"
        ]
        assert position(config) is None

        # 3. writable: the daemon starts; the lake turns read-only while it works through more backlog.
        remount(mnt, "rw")
        run_to_end(config, node_dir, tmp_path / "run-1.err")
        check_lake(lake, node_dir)
        make_node(node_dir, segments=20, tx_per_segment=40, first_tx=n)
        expected = wal_events(node_dir)
        positions = [tuple(e["pos"]) for e in expected]
        err = tmp_path / "run-2.err"
        proc = start(config, err)
        try:
            wait_started(proc, err)
            landed = len(landed_positions(lake))
            wait_for(lambda: len(landed_positions(lake)) > landed or proc.poll() is not None, 120, "new batches")
            remount(mnt, "ro")
            rc = proc.wait(120)
        finally:
            reap(proc)
        assert rc == 4, err.read_text()[-3000:]
        lines = error_lines(err.read_text())
        assert len(lines) == 1 and lines[0].startswith("cdcd: error: consumer on_events() failing for"), lines
        assert "(retry_timeout_s = 3)" in lines[0], lines[0]
        assert "Read-only file system" in lines[0] and str(lake) in lines[0], lines[0]
        assert err.read_text().rstrip("\n").splitlines()[-1] == lines[0], "no traceback after the error line"
        after = position(config)
        assert after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "stopped mid-backlog"
        check_state_matches_lake(lake, positions, record_sizes(expected), after)

        # 4. writable again: everything, exactly once.
        remount(mnt, "rw")
        run_to_end(config, node_dir, tmp_path / "run-3.err")
        check_lake(lake, node_dir, expected)


# --- a full disk -------------------------------------------------------------------------------------
def test_full_disk_is_waited_out_then_everything_lands_once(tmp_path: Path) -> None:
    """A lake file system filling up mid-backlog is a transient failure: `cdcd run` keeps running and logs
    consumer_retrying lines naming the lake and "No space left on device", its state exactly where the lake ends;
    once the file system is grown the same daemon lands every entry exactly once and stops cleanly."""
    node_dir = tmp_path / "node"
    make_node(node_dir, segments=20, tx_per_segment=50)
    expected = wal_events(node_dir)
    positions = [tuple(e["pos"]) for e in expected]
    with tmpfs(tmp_path / "mnt", "size=512k") as mnt:
        lake = mnt / "lake"
        config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=3000)
        err = tmp_path / "run-1.err"
        proc = start(config, err)
        try:

            def retrying() -> list[dict[str, Any]]:
                return [e for e in log_events(err) if e["event"] == "consumer_retrying"]

            wait_for(lambda: proc.poll() is not None or len(retrying()) >= 2, 300, "retries of the full disk")
            assert proc.poll() is None, err.read_text()[-3000:]
            step = retrying()[0]
            assert "No space left on device" in step["error"] and str(lake) in step["error"], step
            assert step["error"].startswith("RetriableError: lake "), step
            after = position(config)
            assert landed_positions(lake), "some batches landed before the disk was full"
            assert after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "stopped mid-backlog"
            check_state_matches_lake(lake, positions, record_sizes(expected), after)
            remount(mnt, "size=256m")
            wait_caught_up(proc, config, node_dir, err, 300)
        finally:
            rc = stop_daemon(proc, timeout=60)
        assert rc == 0 and error_lines(err.read_text()) == [], err.read_text()[-3000:]
        check_lake(lake, node_dir, expected)
