"""Fault injection on the Spark lake sink (DESIGN §7): ``cdcd run`` SIGKILLed at every step of a batch commit, an
unwritable lake, a full disk, and the clean-up of staging left by dead writers.

Everything is checked against the WAL with the helpers of ``test_lake.py``: after each fault the commit log's
entries cover disjoint ranges and no Parquet file under ``changes/`` is unnamed by the log (so a reader never sees
staging or an orphan), the daemon's committed position is never past what the lake holds, and after the fault is
gone a clean run leaves exactly one row per WAL data entry and an empty ``_staging``.

Kill points inside a commit are reached with ``KillingSpark`` (the real SparkLakeConsumer; its module's ``os.link``
/ ``os.rename`` hooked to SIGKILL the process at the chosen step); the Spark write itself is hit from outside.
Mounting tmpfs file systems (read-only, tiny) needs root with CAP_SYS_ADMIN; those tests skip otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cdcd.lake.log import LakeLog
from tests.support.lake import (
    QUICK_START,
    check_lake,
    check_log_invariants,
    check_state_matches_lake,
    covered_below,
    error_lines,
    position,
    process_tree,
    read_log,
    run_to_end,
    spark_consumer,
    staging_contents,
    visible_files,
    wait_gone,
    wait_started,
    write_config,
)
from tests.support.procs import child_env, wait_for
from tests.support.wal import archived_segments, cdc_links, wal_events
from tests.support.writer import make_node

CDCD = [sys.executable, "-m", "cdcd"]

KILL_PLUGIN = '''
"""The real SparkLakeConsumer, SIGKILLing its own process at one step of its n-th batch commit (or of recovery)."""
import json
import os
import signal
from pathlib import Path

import cdcd.lake.log as lake_log
from cdcd.sinks.spark import SparkLakeConsumer, SparkOptions


class _Os:
    """cdcd.lake.log's ``os``: link (the commit point) and rename (publishing) call the hook."""

    def __init__(self, hook):
        self._hook = hook

    def __getattr__(self, name):
        return getattr(os, name)

    def link(self, src, dst, **kw):
        self._hook("before-link", src)
        os.link(src, dst, **kw)
        self._hook("after-link", src)

    def rename(self, src, dst, **kw):
        os.rename(src, dst, **kw)
        self._hook("rename", src)


class KillingSpark(SparkLakeConsumer):
    def __init__(self, kill_at, kill_commit, marker, **options):
        super().__init__(SparkOptions(**options))
        self.kill_at = kill_at  # before-link | after-link | publish-partial | publish-all | published | in-recovery
        self.kill_commit = kill_commit  # the n-th commit of this process (1-based)
        self.marker = Path(marker)
        self.commits = self.renames = self.files = 0
        self.batch = None
        lake_log.os = _Os(self._hook)

    def start(self, registry=None):
        super().start(registry)  # recovery's own publishing happens before the hooks count
        publish = self._log.publish

        def counted(entry):
            self.renames, self.files, self.batch = 0, len(entry.files), entry.batch
            publish(entry)
            self._hook("published", None)

        self._log.publish = counted

    def _hook(self, step, src):
        if self.kill_at == "in-recovery":  # start() finishing an earlier run's publish: die after its first move
            if step == "rename" and self.commits == 0:
                batch = Path(src).relative_to(self.lake / "_staging").parts[0]
                self.marker.write_text(json.dumps({"at": self.kill_at, "batch": batch, "renames": 1}))
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if step == "before-link":
            self.commits += 1
            self.batch = Path(src).name[1:-4]  # .<batch>.tmp
        if self.commits != self.kill_commit:
            return
        if step == "rename":
            self.renames += 1
        kill = step == self.kill_at
        if step == "rename":
            partial = self.kill_at == "publish-partial" and self.renames == max(1, self.files - 1)
            kill = partial or (self.kill_at == "publish-all" and self.renames == self.files)
        if kill:
            info = {"at": self.kill_at, "batch": self.batch, "renames": self.renames, "files": self.files}
            self.marker.write_text(json.dumps(info))
            os.kill(os.getpid(), signal.SIGKILL)
'''

IN_PROCESS = ("before-link", "after-link", "publish-partial", "publish-all", "published")
EXTERNAL = ("spark-write", "random")
KILLS = 16
"""Plus one "in-recovery" kill right after the first "after-link" one."""
SEED = 7_104
COMMITTED = ("after-link", "publish-partial", "publish-all", "published", "in-recovery")
"""Kills after a batch's commit point, before the daemon confirmed it: the next run re-delivers it."""


def lake_consumer(lake: Path, **options: Any) -> dict[str, Any]:
    return spark_consumer(lake, "local[1]", spark_conf=QUICK_START, **options)


# --- helpers ---------------------------------------------------------------------------------------
def start(config: Path, err: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with err.open("ab") as f:
        return subprocess.Popen(
            [*CDCD, "run", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=f, env=env or child_env()
        )


def log_event_names(err: Path) -> list[str]:
    return [json.loads(line)["event"] for line in err.read_text().splitlines() if line.startswith("{")]


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    """``mount -o remount,OPTIONS`` (retried while a writer holds a file open: EBUSY for ro)."""
    deadline = time.monotonic() + 30
    while True:
        res = subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True, text=True)
        if res.returncode == 0:
            return
        assert time.monotonic() < deadline, res.stderr
        time.sleep(0.01)


# --- SIGKILL at every step of a batch commit ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_at_every_commit_step_lands_everything_exactly_once(tmp_path: Path, spark: Any) -> None:
    """SIGKILLing `cdcd run` 17 times during the Spark write, before/after the log link, between/after the publish
    renames, while recovery publishes and at random, while it works through a backlog, never shows readers an
    unnamed file, never commits the daemon past the lake, and a final clean run leaves every WAL entry in the change
    log exactly once."""
    rng = random.Random(SEED)
    t0 = time.monotonic()
    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=30, tx_per_segment=50)  # ~75k entries
    expected = wal_events(node_dir)
    positions = [tuple(e["pos"]) for e in expected]
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "lake_kill.py").write_text(KILL_PLUGIN)
    env = child_env(plugins)
    settings = {"batch_max_events": 2000, "batch_max_delay_ms": 50}
    phases = [*IN_PROCESS, *IN_PROCESS, *EXTERNAL, *EXTERNAL]
    phases += rng.sample([*IN_PROCESS, *EXTERNAL], KILLS - len(phases))
    rng.shuffle(phases)
    phases.insert(phases.index("after-link") + 1, "in-recovery")
    marker = tmp_path / "killed.json"
    runs: list[dict[str, Any]] = []
    for k, phase in enumerate(phases):
        err = tmp_path / f"daemon-{k}.err"
        # Both writers take turns on one lake; the Spark write is hit from outside while it runs.
        writer = "spark" if phase == "spark-write" else rng.choice(["arrow", "spark"])
        options = lake_consumer(lake, app_name=f"cdcd-kill-{k}", writer=writer)
        if phase in (*IN_PROCESS, "in-recovery"):
            table = {"kind": "python", "class": "lake_kill:KillingSpark"}
            table["options"] = {"kill_at": phase, "kill_commit": rng.randint(1, 2), "marker": str(marker)}
            table["options"].update({key: v for key, v in options.items() if key != "kind"})
            options = table
        config = write_config(tmp_path / "cdcd.toml", node_dir, options, **settings)
        before = position(config)
        staged_before = set(os.listdir(lake / "_staging")) if (lake / "_staging").exists() else set()
        proc = start(config, err, env)
        jvm: list[int] = []
        if phase != "in-recovery":  # that run dies in start(), before Spark
            wait_started(proc, err)
            jvm = process_tree(proc.pid)
            assert bool(jvm) == (writer == "spark"), "only the Spark writer runs a JVM under the daemon"
        if phase == "spark-write":

            def new_staging(seen: set[str] = staged_before) -> bool:
                return proc.poll() is not None or bool(set(os.listdir(lake / "_staging")) - seen)

            wait_for(new_staging, 120, "a Spark write into _staging", interval=0.005)
            time.sleep(rng.uniform(0, 0.6))
            proc.send_signal(signal.SIGKILL)
        elif phase == "random":
            time.sleep(rng.uniform(0, 3))
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(180)
        assert rc == -signal.SIGKILL, f"run {k} ({phase}): exit {rc}\n" + err.read_text()[-3000:]
        wait_gone(jvm)
        info: dict[str, Any] = {"phase": phase, "before": before, "after": position(config)}
        if phase in (*IN_PROCESS, "in-recovery"):
            assert marker.exists(), f"run {k}: the {phase} hook did not fire"
            info |= json.loads(marker.read_text())
            marker.unlink()
        runs.append(info)

        # What a reader could see right now, and the daemon's state.
        entries = check_log_invariants(lake, positions)
        covered_below(lake, positions, info["after"])
        assert info["after"] is None or before is None or info["after"] >= before
        if phase in (*IN_PROCESS, "in-recovery"):
            batch = info["batch"]
            mine = [e for e in entries if e.batch == batch]
            staged = lake / "_staging" / batch
            tmp_log = lake / "_cdcd_log" / f".{batch}.tmp"
            if phase == "before-link":
                assert not mine and tmp_log.exists() and staged.is_dir(), "killed before the commit point"
            else:
                assert len(mine) == 1 and entries[-1].batch == batch, "killed after the commit point"
                published = [rel for rel in mine[0].files if (lake / "changes" / rel).exists()]
                n = len(mine[0].files)
                want = {"after-link": 0, "publish-partial": max(1, n - 1), "publish-all": n, "published": n}.get(phase)
                if phase == "in-recovery":
                    assert runs[-2]["phase"] == "after-link" and runs[-2]["batch"] == batch, "recovering the last kill"
                    want = 1
                assert len(published) == want, f"{phase}: {len(published)} of {n} files published"
                assert staged.is_dir() == (phase != "published")

    # The final run, with the plain `kind = "spark"` config, catches up and stops cleanly.
    config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), **settings)
    final_err = tmp_path / "daemon-final.err"
    run_to_end(config, node_dir, final_err)
    assert position(config) == (max(archived_segments(node_dir)) + 1, 0, 0)
    assert cdc_links(node_dir) == {}
    check_lake(spark, lake, node_dir, expected)

    # Each run after a kill past the commit point re-delivered that batch, and the lake dropped it.
    n_runs = len(runs)
    for k in range(1, n_runs + 1):
        prev = runs[k - 1]
        err = tmp_path / (f"daemon-{k}.err" if k < n_runs else "daemon-final.err")
        if prev["phase"] in COMMITTED and (k == n_runs or runs[k]["phase"] not in ("random", "in-recovery")):
            assert "lake_replay_dropped" in log_event_names(err), f"run {k} after a kill at {prev['phase']}"
    landed = [r for r in runs if r["after"] != r["before"]]
    assert len(landed) >= KILLS // 2, "most runs landed batches before their kill"
    counts = {p: sum(1 for r in runs if r["phase"] == p) for p in (*IN_PROCESS, *EXTERNAL, "in-recovery")}
    print(f"\n{n_runs} kills {counts}, {len(expected)} entries, {time.monotonic() - t0:.0f}s")


# --- an unwritable lake ------------------------------------------------------------------------------
def test_unwritable_lake_exits_4_then_lands_everything_once(tmp_path: Path, spark: Any) -> None:
    """A lake on a read-only mount or below a regular file: `cdcd run` exits 4 with one error line naming the path and
    leaves its state alone; a lake turning read-only mid-run: exit 4, state not past the lake; once writable again a
    restarted daemon lands every entry exactly once."""
    node_dir = tmp_path / "node"
    n = make_node(node_dir, segments=8, tx_per_segment=40)
    settings = {"batch_max_events": 3000}
    with tmpfs(tmp_path / "mnt", "ro,size=64m") as mnt:
        lake = mnt / "lake"
        # 1. read-only from the start: fails in start(), before Spark starts.
        config = write_config(tmp_path / "cdcd.toml", node_dir, lake_consumer(lake), **settings)
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
        check_lake(spark, lake, node_dir)
        make_node(node_dir, segments=20, tx_per_segment=40, first_tx=n)
        expected = wal_events(node_dir)
        positions = [tuple(e["pos"]) for e in expected]
        err = tmp_path / "run-2.err"
        proc = start(config, err)
        try:
            wait_started(proc, err)
            landed = len(read_log(lake))
            wait_for(lambda: len(read_log(lake)) > landed + 1 or proc.poll() is not None, 120, "new batches")
            remount(mnt, "ro")
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert rc == 4, err.read_text()[-3000:]
        lines = error_lines(err.read_text())  # one line, but see test_failed_spark_write_is_one_clear_error_line
        assert len(lines) == 1 and lines[0].startswith("cdcd: error: consumer on_events() raised"), lines
        after = position(config)
        assert after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "stopped mid-backlog"
        check_log_invariants(lake, positions)
        check_state_matches_lake(lake, positions, after)

        # 4. writable again: everything, exactly once.
        remount(mnt, "rw")
        run_to_end(config, node_dir, tmp_path / "run-3.err")
        check_lake(spark, lake, node_dir, expected)


# --- a full disk -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A daemon run that fills its 256 KiB lake file system mid-backlog (~50k entries, ~9 bytes each as Parquet);
    the mount stays until the module ends, so the tests can look at the failure and then grow the disk."""
    tmp = tmp_path_factory.mktemp("full-disk")
    node_dir = tmp / "node"
    make_node(node_dir, segments=20, tx_per_segment=50)
    with tmpfs(tmp / "mnt", "size=256k") as mnt:
        lake = mnt / "lake"
        config = write_config(tmp / "cdcd.toml", node_dir, lake_consumer(lake), batch_max_events=3000)
        err = tmp / "run-1.err"
        proc = start(config, err)
        try:
            rc = proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        yield {"tmp": tmp, "node_dir": node_dir, "mnt": mnt, "lake": lake, "config": config, "err": err, "rc": rc}


def test_full_disk_exits_4_then_lands_everything_once(full_disk: dict[str, Any], spark: Any) -> None:
    """A lake file system filling up mid-backlog makes `cdcd run` exit 4 with its state not past the lake and no
    partial file visible; after growing the file system a restarted daemon lands every entry exactly once and leaves
    no staging behind."""
    node_dir, lake, config, err = full_disk["node_dir"], full_disk["lake"], full_disk["config"], full_disk["err"]
    expected = wal_events(node_dir)
    positions = [tuple(e["pos"]) for e in expected]
    assert full_disk["rc"] == 4, err.read_text()[-3000:]
    lines = error_lines(err.read_text())
    assert len(lines) == 1 and lines[0].startswith("cdcd: error: consumer on_events() raised"), lines
    after = position(config)
    entries = check_log_invariants(lake, positions)
    assert entries, "some batches landed before the disk was full"
    check_state_matches_lake(lake, positions, after)
    assert after is not None and after < (max(archived_segments(node_dir)) + 1, 0, 0), "stopped mid-backlog"

    remount(full_disk["mnt"], "size=256m")
    run_to_end(config, node_dir, full_disk["tmp"] / "run-2.err")
    check_lake(spark, lake, node_dir, expected)


def test_failed_spark_write_is_one_clear_error_line(full_disk: dict[str, Any]) -> None:
    """When the lake's disk is full, `cdcd run` ends with a single `cdcd: error:` line that names the cause."""
    text = full_disk["err"].read_text()
    lines = error_lines(text)
    assert len(lines) == 1
    assert text.rstrip("\n").splitlines()[-1] == lines[0], "nothing (no stack trace) follows the error line"
    assert "No space left on device" in lines[0] or "Mkdirs failed" in lines[0], lines[0]


# --- staging of dead writers ---------------------------------------------------------------------------
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def proc_start(pid: int) -> str:
    """A process's start time (clock ticks since boot), field 22 of /proc/<pid>/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def batch_id(host: str, pid: int, started: str) -> str:
    """A batch id as cdcd.lake.log.new_batch_id makes it: ``<host>-<pid>-<process start>-<random>``."""
    return f"{host}-{pid}-{started}-0123456789ab"


def fake_staging(lake: Path, batch: str) -> Path:
    d = lake / "_staging" / batch / "cache=orders"
    d.mkdir(parents=True)
    (d / "part-00000.parquet").write_bytes(b"PAR1")
    return d.parent


def test_recover_deletes_a_dead_writers_staging(tmp_path: Path) -> None:
    """LakeLog.recover() deletes uncommitted staging and temp log files of a dead writer on this host, keeps a live
    writer's, and never makes any of it visible under changes/."""
    from cdcd.lake.log import new_batch_id

    lake = tmp_path / "lake"
    LakeLog(lake)
    host = socket.gethostname()
    assert new_batch_id().startswith(f"{host}-{os.getpid()}-{proc_start(os.getpid())}-"), "the documented format"
    dead = fake_staging(lake, batch_id(host, dead_pid(), "12345"))
    (lake / "_cdcd_log" / f".{dead.name}.tmp").write_text("{")
    live = fake_staging(lake, batch_id(host, os.getppid(), proc_start(os.getppid())))
    (lake / "_cdcd_log" / f".{live.name}.tmp").write_text("{")
    other_host = fake_staging(lake, batch_id("another-host", dead_pid(), "12345"))
    LakeLog(lake).recover()
    assert not dead.exists() and live.exists() and other_host.exists()
    assert [p.name for p in (lake / "_cdcd_log").iterdir()] == [f".{live.name}.tmp"]
    assert visible_files(lake) == set()


def test_recover_deletes_dead_staging_on_a_hyphenated_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host whose name contains '-', recover() still deletes a dead writer's staging and temp log file."""
    monkeypatch.setattr(socket, "gethostname", lambda: "ip-10-0-0-7")
    lake = tmp_path / "lake"
    LakeLog(lake)
    dead = fake_staging(lake, batch_id("ip-10-0-0-7", dead_pid(), "12345"))
    (lake / "_cdcd_log" / f".{dead.name}.tmp").write_text("{")
    LakeLog(lake).recover()
    assert staging_contents(lake) == []
    assert [p.name for p in (lake / "_cdcd_log").iterdir()] == []


def test_recover_deletes_staging_of_a_dead_run_with_the_same_pid(tmp_path: Path) -> None:
    """Staging left by a previous run that had this process's pid (a container's PID 1) is deleted by recover()."""
    lake = tmp_path / "lake"
    LakeLog(lake)
    started = int(proc_start(os.getpid()))
    fake_staging(lake, batch_id(socket.gethostname(), os.getpid(), str(started - 1)))  # an earlier process
    LakeLog(lake).recover()
    assert staging_contents(lake) == []


# --- an error after the commit point --------------------------------------------------------------------
def wal_batch(node_dir: Path) -> Any:
    """All data records of a node's WAL as one EventBatch (what the daemon would hand the sink)."""
    from cdcd.consumer import EventBatch, RecordSlice
    from cdcd.wal import CacheRecord, DataRecord
    from tests.support.wal import wal_records

    names: dict[int, str] = {}
    slices = []
    for ptr, rec in wal_records(node_dir):
        if type(rec) is CacheRecord:
            names[rec.cache_id] = rec.name
        elif type(rec) is DataRecord:
            slices.append(RecordSlice(ptr, rec, 0))
    return EventBatch("test-node", slices, names)


def test_error_after_the_commit_point_keeps_the_batch_recoverable(
    tmp_path: Path,
    spark: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An I/O error after a batch's log entry is linked (fsync of the log dir fails) fails the batch, but a restarted
    sink recovers: it publishes the committed files and the re-delivered batch lands nothing twice."""
    import cdcd.lake.log as lake_log
    from cdcd.sinks.spark import SparkLakeConsumer, SparkOptions

    node_dir, lake = tmp_path / "node", tmp_path / "lake"
    make_node(node_dir, segments=2, tx_per_segment=10)
    batch = wal_batch(node_dir)
    real_fsync_dir = lake_log.fsync_dir
    failed: list[Path] = []

    def fsync_dir(path: Path) -> None:
        if path.name == "_cdcd_log" and not failed:
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    monkeypatch.setattr(lake_log, "fsync_dir", fsync_dir)
    options = SparkOptions(lake_path=str(lake), spark_master="local[2]")
    sink = SparkLakeConsumer(options)
    sink.start()
    try:
        with pytest.raises(OSError, match="Input/output error"):
            sink.on_events(batch)
    finally:
        sink.stop()
    assert failed and len(read_log(lake)) == 1, "the entry was committed before the error"

    sink = SparkLakeConsumer(options)
    sink.start()  # recovery
    try:
        assert sink.on_events(batch) is True  # the daemon re-delivers the unconfirmed batch
    finally:
        sink.stop()
    check_lake(spark, lake, node_dir)
